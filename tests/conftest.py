"""Test-wide settings. Triton must see TRITON_INTERPRET before any kernel is decorated."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

import triton_interpreter  # noqa: E402,F401  (installs itself: a faster interpreter, same results)


def _intra_op_threads() -> int:
    """The cores each test process may use: all of them (at most two: the CI machine has two,
    more only adds contention for these small tensors), shared out over pytest-xdist workers
    (``-n``): two workers with two OpenMP threads each would spin against each other."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, (os.cpu_count() or 1) // workers))


torch.set_num_threads(_intra_op_threads())
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # The processes the tests start (omni train, torchrun ranks) share the cores the same way.
    os.environ.setdefault("OMP_NUM_THREADS", str(_intra_op_threads()))


# The longest files, longest first (seconds each took under `-n 2 --dist loadfile` on the
# 2-core CI machine, 2026-12-05: 177, 160, 129, 99, 68, 61, 43, 36, 35, 34, 31, 28, 27, 27, 23,
# 22, 22). pytest-xdist hands the scopes to its two workers in the order their first test
# comes: the files that start ranks are one scope (``suite_schedule``), whose first test is the
# first here, then the demo, then the rest of the single-process files, longest first (how a
# fixed set of jobs is best shared out; a file missing here only runs later). The README's
# command passes --no-loadscope-reorder: without it pytest-xdist (3.8) queues the scopes by their
# number of tests, most first, and this order is lost.
LONGEST_FIRST = [
    "runtime/test_faults.py", "test_demo_learns.py", "parallel/test_device_rules_layouts.py",
    "runtime/test_faults_hangs.py",
    "multiplex/test_multiplex_equal_single.py", "parallel/test_layouts_equal_single.py", "test_export_cmd.py",
    "sim/test_simulate.py", "parallel/test_startup_scale.py", "test_recipes_train.py", "test_gpu_check.py",
    "data/test_data_ray.py", "multiplex/test_multiplex_grouped_p2p.py", "parallel/test_cli_layouts.py",
    "runtime/test_validation.py", "runtime/test_stop.py", "runtime/test_stages.py",
    "multiplex/test_multiplex_bubbles.py",
]


def pytest_xdist_make_scheduler(config, log):
    """The files that start ranks run as one scope (``suite_schedule``)."""
    from suite_schedule import make_scheduler

    return make_scheduler(config, log)


def pytest_collection_modifyitems(config, items):
    """The longest files first (``LONGEST_FIRST``), then the long end-to-end tests (``slow``),
    the longest of them (``slow(first=True)``) before the rest."""
    here = os.path.dirname(os.path.abspath(__file__))
    place = {os.path.join(here, name): i for i, name in enumerate(LONGEST_FIRST)}

    def rank(item) -> tuple[int, int]:
        slow = item.get_closest_marker("slow")
        return (place.get(str(item.path), len(place)), 2 if slow is None else 0 if slow.kwargs.get("first") else 1)

    items.sort(key=rank)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Each test starts with the handlers the session had: Ray's driver installs a SIGTERM
    handler of its own at ``ray.init`` and keeps it after ``ray.shutdown``; left in place it
    would reach every later test and every process forked from this one."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in before.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)


@pytest.fixture
def seed():
    torch.manual_seed(0)
    return 0


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory):
    """A small demo dataset (shapes, tones, text + eval), written once per test session."""
    from dataloading.demo import write_demo_dataset

    return write_demo_dataset(tmp_path_factory.mktemp("demo"), seed=0, scale=0.05, progress=False)
