"""Test-wide settings. Triton must see TRITON_INTERPRET before any kernel is decorated."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Two cores on the CI machine: more intra-op threads only adds contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def seed():
    torch.manual_seed(0)
    return 0


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory):
    """A small demo dataset (shapes, tones, text + eval), written once per test session."""
    from dataloading.demo import write_demo_dataset

    return write_demo_dataset(tmp_path_factory.mktemp("demo"), seed=0, scale=0.05, progress=False)
