"""Test-wide settings. Triton must see TRITON_INTERPRET before any kernel is decorated."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Two cores on the CI machine: more intra-op threads only adds contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    """The long end-to-end tests (``slow``) first, the longest of them (``slow(first=True)``)
    before the rest: a worker that starts one late runs on alone after the others have run out
    of work (longest first is how a fixed set of jobs is best shared out)."""
    def rank(item) -> int:
        slow = item.get_closest_marker("slow")
        return 2 if slow is None else 0 if slow.kwargs.get("first") else 1

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
