"""``local_grad_square_sum`` (the squared gradient norm each rank contributes) reads every
gradient once: no gradient-sized temporary, fp64 or other, and no copy of a gradient (the
former ``g.double().pow(2).sum()`` made two fp64 copies of each). It equals the fp64 sum to fp32
accumulation (1e-6 relative), divides each gradient by its copies and leaves ``skip`` out, and
stays on the device as a 0-dim fp64 tensor."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parallel import grad_norm
from parallel.grad_norm import local_grad_square_sum

SHAPES = [(64, 48), (48,), (300,), (16, 16, 4), (128, 3)]


def _params():
    gen = torch.Generator().manual_seed(0)
    params = []
    for i, shape in enumerate(SHAPES):
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=gen) * 10.0 ** (i - 2)  # magnitudes 1e-2 .. 1e2
        params.append(p)
    # a bf16 gradient (its own group): accumulated in fp32 too
    p = torch.nn.Parameter(torch.zeros(200, dtype=torch.bfloat16))
    p.grad = torch.randn(200, generator=gen).to(torch.bfloat16)
    params.append(p)
    return params


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.ops.append((func._schema.name, args, [o for o in outs if isinstance(o, torch.Tensor)]))
        return out


def test_no_gradient_sized_temporary_and_no_copy_of_a_gradient():
    params = _params()
    smallest = min(p.grad.numel() for p in params)
    grads = {p.grad.untyped_storage().data_ptr() for p in params}
    with _Record() as rec:
        total = local_grad_square_sum(params, stage_world=1)
    assert rec.ops, "nothing recorded: the check would pass vacuously"
    for name, args, outs in rec.ops:
        for o in outs:
            assert o.numel() < smallest, (name, o.dtype, tuple(o.shape))
        if name == "aten::_to_copy":
            assert not any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in grads for a in args), name
    assert total.dim() == 0 and total.dtype == torch.float64


def test_equals_the_fp64_sum_with_copies_and_skip(monkeypatch):
    params = _params()
    # divisors per tensor, as DTensor placements give them: the groups must keep each its own
    divisor = {id(p.grad): d for p, d in zip(params, [1, 3, 2, 1, 3, 2])}
    monkeypatch.setattr(grad_norm, "_copies", lambda g, stage_world: divisor[id(g)] * stage_world)
    skip = [params[4]]
    got = local_grad_square_sum(params, stage_world=2, skip=skip)
    want = sum(float(p.grad.double().square().sum()) / (divisor[id(p.grad)] * 2)
               for p in params if p is not params[4])
    assert abs(float(got) - want) <= 1e-6 * want, (float(got), want)
    # the skipped gradient is the largest: counting it would be far off
    assert float(params[4].grad.double().square().sum()) > want
    no_grad = torch.nn.Parameter(torch.zeros(3))  # no gradient: left out, no error
    assert float(local_grad_square_sum([no_grad], stage_world=1)) == 0.0
