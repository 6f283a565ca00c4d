"""One encoder call per modality per insertion point (multiplex.chunks_per_cut chunks at once;
encoder_first: the whole step), in one process: ``MediaTower.encode`` runs once per modality
per cut group, and training still equals the inline single-process run (fp32, 1e-5: losses,
gradient norms, every first-step gradient), whichever exchange mode is set."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from layout_harness import compare, reference, run_layout  # noqa: E402

BOTH = {"moe": False, "num_layers": 4, "media": ("image", "audio")}
DATA = {"steps": 2}  # 4 micro-batches per step, each with image and audio items


@pytest.fixture(scope="module")
def ref():
    return reference(data=DATA, **BOTH)


@pytest.fixture(autouse=True)
def own_process_group():
    """``run_layout`` in this process creates a one-rank process group; each test ends the
    group it created, pass or fail, so none outlives this module (a later test that makes its
    own group, tests/sim/test_sim_encoder_costs.py, would find it there)."""
    import torch.distributed as dist

    had_one = dist.is_initialized()
    try:
        yield
    finally:
        if dist.is_initialized() and not had_one:
            dist.destroy_process_group()


@pytest.mark.parametrize("mux,calls_per_step", [
    ({"chunks_per_cut": 1}, 4),  # a call per chunk
    ({"chunks_per_cut": 2}, 2),
    ({"chunks_per_cut": 3, "exchange": "p2p"}, 2),  # cuts 0 and 3: chunks 0-2, then 3
    ({"placement": "encoder_first", "chunks_per_cut": 2}, 1),  # one insertion point, before the pipeline
    ({}, 1),  # the default, auto: no memory budget on the CPU, one call per step
    # auto under a budget no chunk's activations fit (50 bytes): back to a call per chunk
    ({"chunks_per_cut": "auto", "encoder_memory_mib": str(50 / 2**20)}, 4),
])
def test_one_encode_per_modality_per_insertion_point(mux, calls_per_step, ref, monkeypatch):
    from omni.multiplex.media_tower import MediaTower

    calls = []
    real = MediaTower.encode

    def counted(self, modality, *args, **kwargs):
        calls.append(modality)
        return real(self, modality, *args, **kwargs)

    monkeypatch.setattr(MediaTower, "encode", counted)
    result = run_layout(0, dict(dp_shard=1), data=DATA, multiplex=mux, **BOTH)
    steps = DATA["steps"]
    assert sorted(calls) == sorted(["audio", "image"] * calls_per_step * steps)
    assert compare(result, ref) == []
