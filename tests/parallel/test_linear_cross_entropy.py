"""The chunked LM head + cross-entropy (parallel/linear_cross_entropy.py) against the plain
``F.cross_entropy(F.linear(...))``: loss and gradients equal in fp32 (1e-5) and under bf16
autocast, with and without tensor parallelism, and nothing of ``targets x vocab`` elements saved
for the backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_helpers import run_ranks
from parallel.linear_cross_entropy import chunk_rows, linear_cross_entropy

N, H, V = 11, 16, 50


def _inputs(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H ** 0.5
    labels = torch.randint(0, V, (n,), generator=g)
    return hidden, weight, labels


def _reference(hidden, weight, labels, autocast=False):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = F.cross_entropy(F.linear(h, w).float(), labels, reduction="sum")
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _chunked(hidden, weight, labels, rows, autocast=False, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = linear_cross_entropy(h, w, labels, rows=rows, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("rows", [1, 4, N, 1000])
def test_equal_to_the_plain_loss_in_fp32(rows):
    ref, got = _reference(*_inputs()), _chunked(*_inputs(), rows=rows)
    assert _rel(got[0], ref[0]) <= 1e-6
    assert _rel(got[1], ref[1]) <= 1e-5 and _rel(got[2], ref[2]) <= 1e-5


def test_close_to_the_plain_loss_under_bf16_autocast():
    """Both run the head's matmuls in bf16 and the softmax in fp32: the loss agrees to fp32
    rounding of the same bf16 logits; the gradients to bf16 rounding (the chunked head sums its
    weight gradient over chunks in fp32, the plain one in one bf16 matmul)."""
    ref, got = _reference(*_inputs(), autocast=True), _chunked(*_inputs(), rows=4, autocast=True)
    assert _rel(got[0], ref[0]) <= 1e-6
    assert _rel(got[1], ref[1]) <= 1e-2 and _rel(got[2], ref[2]) <= 1e-2
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32  # the leaves' own dtypes


def test_no_targets():
    hidden, weight, labels = _inputs(n=0)
    loss, gh, gw = _chunked(hidden, weight, labels, rows=4)
    assert float(loss) == 0.0 and gh.shape == (0, H) and float(gw.abs().sum()) == 0.0


def test_nothing_of_targets_x_vocab_is_saved_for_the_backward():
    """The plain loss saves [N, V] logits for its backward; the chunked one only [N]-sized
    statistics and its inputs."""
    hidden, weight, labels = _inputs(n=64)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear_cross_entropy(h, w, labels, rows=8).backward()
    assert saved and max(saved) < 64 * V
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(F.linear(hidden.clone().requires_grad_(), weight), labels, reduction="sum").backward()
    assert max(saved) >= 64 * V  # what the plain loss keeps


def test_chunk_rows_bound_one_chunks_logits():
    assert chunk_rows(151_936) * 151_936 * 4 <= 256 * 2 ** 20 < (chunk_rows(151_936) + 1) * 151_936 * 4
    assert chunk_rows(10) >= 1 and chunk_rows(0) >= 1


def _tp_worker(rank, world, out_dir):
    import torch.distributed as dist

    from parallel.tensor_parallel import vocab_range

    hidden, weight, labels = _inputs(seed=1)
    out = {}
    for autocast in (False, True):
        start, end = vocab_range(V, world, rank)
        h, w = hidden.clone().requires_grad_(), weight[start:end].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = linear_cross_entropy(h, w, labels, start, dist.group.WORLD, rows=3)
        loss.backward()
        grad_h = h.grad.clone()
        dist.all_reduce(grad_h)  # the caller sums the ranks' shares of the hidden gradient
        out[autocast] = (loss.detach(), grad_h, w.grad, start, end)
    torch.save(out, f"{out_dir}/rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 3])  # 3: vocabulary rows split unevenly (17, 17, 16)
def test_vocabulary_parallel_equals_the_whole_head(world, tmp_path):
    run_ranks(_tp_worker, world, str(tmp_path), timeout_s=120)
    for autocast, tol in ((False, 1e-5), (True, 1e-2)):
        loss, gh, gw = _reference(*_inputs(seed=1), autocast=autocast)
        for rank in range(world):
            got_loss, got_h, got_w, start, end = torch.load(tmp_path / f"rank{rank}.pt")[autocast]
            assert _rel(got_loss, loss) <= 1e-6, (autocast, rank)
            assert _rel(got_h, gh) <= tol and _rel(got_w, gw[start:end]) <= tol, (autocast, rank)


def test_liger_fused_kernel_equals_the_reference():
    """The fused path a GPU takes where liger-kernel is installed (Triton, interpreted here, in
    fp32: the interpreter's bf16 is wrong): loss and gradients equal F.cross_entropy(F.linear)
    within 1e-5, at a size its kernel splits into several chunks of rows."""
    pytest.importorskip("liger_kernel")
    from parallel.linear_cross_entropy import fused_linear_cross_entropy

    hidden, weight, labels = _inputs(seed=4, n=300)
    want = _reference(hidden, weight, labels)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, labels)
    loss.backward()
    for name, a, b in zip(("loss", "d hidden", "d weight"), (loss.detach(), h.grad, w.grad), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_the_fused_loss_is_chosen_on_a_gpu_only():
    """DeviceRules.fused_loss: a GPU with liger-kernel installed; never the CPU, not even under
    CUDA's rules (interpreted bf16 would be wrong); the model takes it without TP only."""
    pytest.importorskip("liger_kernel")
    from parallel.device_rules import DeviceRules

    assert DeviceRules(torch.device("cuda"), cuda=True).fused_loss
    assert not DeviceRules(torch.device("cpu"), cuda=True).fused_loss
    assert not DeviceRules(torch.device("cpu")).fused_loss


def test_the_model_loss_through_the_fused_kernel_equals_the_chunked_one():
    pytest.importorskip("liger_kernel")
    from dataloading.construct.batch import IGNORE_INDEX, MicroBatch
    from omni.models.build import build_model
    from omni.models.config import ModelConfig

    cfg = ModelConfig(family="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1).clone()
    labels[:5] = IGNORE_INDEX
    mb = MicroBatch(ids, torch.arange(40), labels, torch.tensor([0, 40], dtype=torch.int32))
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg, {}, vocab_needed=0)
        model.runtime.fused_loss = fused
        loss = model(mb).ce_sum
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (la, ga), (lb, gb) = results
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU check runs it)")
def test_cuda_fused_loss_under_bf16_equals_the_chunked_one():
    """On a GPU with liger-kernel (carried to the lent machine as a wheel in .whl/): under bf16
    autocast the fused and the chunked losses and gradients agree within 2e-2 of the largest
    element (both keep fp32 logits and accumulate the weight gradient in fp32)."""
    pytest.importorskip("liger_kernel")
    from parallel.linear_cross_entropy import fused_linear_cross_entropy

    hidden, weight, labels = (t.cuda() for t in _inputs(seed=5, n=4096))
    out = []
    for fn in (linear_cross_entropy, fused_linear_cross_entropy):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(h, w, labels)
        loss.backward()
        out.append((loss.detach().float(), h.grad, w.grad))
    for a, b in zip(*out):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()
