"""Which GPU a rank takes: LOCAL_RANK (torchrun sets it), never a silent GPU 0 on a multi-process
launch. CUDA is faked: only the choice is checked, no device is touched."""
from __future__ import annotations

import pytest
import torch

from parallel import layout
from parallel.layout import LayoutError


@pytest.fixture
def fake_gpus(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_local_rank_picks_the_gpu(fake_gpus, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert layout._pick_device() == torch.device("cuda", 3) and fake_gpus == [3]


def test_multi_process_launch_without_local_rank_is_refused(fake_gpus, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(LayoutError, match="LOCAL_RANK is not set"):
        layout._pick_device()
    assert fake_gpus == []


def test_one_process_defaults_to_gpu_0_and_a_bad_local_rank_is_named(fake_gpus, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert layout._pick_device() == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(LayoutError, match="LOCAL_RANK=4 but this node has 4 GPU"):
        layout._pick_device()
