"""One check that two step batches are the same, shared by the data tests (loader and Ray
backends, resume)."""
from __future__ import annotations

import torch

ROW_FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens")


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same_step(a, b, media_fields=("features", "positions"), stats: bool = False) -> None:
    """``a`` and ``b`` hold the same step: its micro-batches' samples, rows and ``media_fields`` of
    every modality (and with ``stats`` the problem counts and plan statistics) equal."""
    assert a.step == b.step and len(a.micro_batches) == len(b.micro_batches)
    if stats:
        assert a.problems == b.problems and a.plan_stats == b.plan_stats
    for x, y in zip(a.micro_batches, b.micro_batches):
        assert x.sample_ids == y.sample_ids
        for name in ROW_FIELDS:
            assert torch.equal(getattr(x, name), getattr(y, name))
        assert x.media.keys() == y.media.keys()
        for m in x.media:
            for name in media_fields:
                assert torch.equal(getattr(x.media[m], name), getattr(y.media[m], name))
