"""The varlen attention kernels address elements past 2**31 (a pack of 262k tokens x 64 heads x
128 dims): their offsets are int64, where int32 would wrap and read far from the tensor.

Checked under TRITON_INTERPRET=1 with little real memory: q, k, v and the incoming gradient
are strided views into one ``torch.empty`` of 2**32 + a few fp16 elements (8 GiB of address
space; only the pages of the rows read are ever touched), with a token stride or a head stride
that puts the third token or head past 2**31 elements. The stride itself stays below 2**31, so
Triton passes it as an int32 argument: the product with the token or head index is what must
not be int32."""
from __future__ import annotations

import pytest
import torch

from omni.kernels import varlen_attention
from omni.kernels.reference import attention_reference

T, H, D = 3, 3, 16
BIG = 2**30 + 64  # index 2 along the big stride sits at 2**31 + 128 elements
# Every view starts this far into the buffer, so that an offset wrapped to a negative int32
# still lands inside it (on zeros) instead of in memory the test does not own.
BASE = 2**31
STRIDES = {"tokens": (BIG, D, 1), "heads": (D, BIG, 1)}  # [T, H, D] views, one stride big


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("big", list(STRIDES))
def test_triton_attention_reads_past_two_to_the_31_elements(big):
    buf = torch.empty(2**32 + 4096, dtype=torch.float16)
    buf[:4096].zero_()  # where int32 offsets wrap to
    gen = torch.Generator().manual_seed(0)
    views = []
    for i in range(4):  # q, k, v and the gradient of the output, side by side
        x = buf.as_strided((T, H, D), STRIDES[big], BASE + 256 * i)
        x.copy_(torch.randn(T, H, D, generator=gen).half())
        views.append(x)
    q, k, v, grad = views
    assert q.storage_offset() + 2 * BIG >= 2**31 > BIG
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cu = torch.tensor([0, T], dtype=torch.int32)

    out = varlen_attention(q, k, v, cu, T, causal=True, backend="triton")
    got = torch.autograd.grad(out, (q, k, v), grad)

    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = attention_reference(q32, k32, v32, cu, causal=True)
    want = torch.autograd.grad(ref, (q32, k32, v32), grad.float())
    # fp16 rounding only (as in test_varlen_attention.py); a wrapped offset reads zeros for
    # the third token or head and is off by order 1
    errors = {"out": _rel(out.detach(), ref.detach()),
              **{n: _rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), got, want)}}
    assert all(e <= 2e-3 for e in errors.values()), errors
