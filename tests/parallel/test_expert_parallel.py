"""Expert parallelism and token groups for the MoE layer equal the single-process MoE.

Four gloo ranks on CPU, fp32. Every rank builds the same MoE (same seed) and the same global
batch, takes its own token slice, and also computes the unsharded reference itself, so each rank
checks its own outputs and the all-reduced gradients without gathering anything.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dist_helpers import run_ranks
from omni.models.llm import DecoderConfig
from omni.models.llm.moe import MoE
from parallel import expert_parallel

H = 32
TOL = dict(rtol=1e-5, atol=1e-5)


def _config(num_experts: int, shared: bool, aux: float = 0.01, z: float = 0.001) -> DecoderConfig:
    return DecoderConfig(
        family="qwen2_moe" if shared else "mixtral", hidden_size=H, intermediate_size=48,
        num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40 if shared else 0, norm_topk_prob=not shared,
        router_aux_loss_coef=aux, router_z_loss_coef=z,
    )


def _moe(cfg: DecoderConfig, suppress_expert0: bool) -> MoE:
    """Same weights on every rank. With ``suppress_expert0`` the router scores expert 0 by the
    first feature alone (weight 8), so tokens whose first feature is -3 never pick it."""
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2)
        moe.router.weight.mul_(1.5)  # decisive routing: no near-ties between experts
        if suppress_expert0:
            moe.router.weight[:, 0] = 0.0
            moe.router.weight[0] = 0.0
            moe.router.weight[0, 0] = 8.0
    return moe


def _batch(sizes, suppress_on):
    """Global tokens and loss weights; rank r's slice is ``sizes[r]`` rows. Ranks in
    ``suppress_on`` get first feature -3 (they never route to expert 0, see ``_moe``)."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, H, generator=g) for n in sizes]
    ts = [torch.randn(n, H, generator=g) for n in sizes]
    for r in suppress_on:
        xs[r][:, 0] = -3.0
    return xs, ts


def _grads(moe: MoE):
    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    return {n: (local(p.grad).clone() if p.grad is not None else torch.zeros_like(local(p)))
            for n, p in moe.named_parameters()}


def _as_dtensor_shards(moe: MoE, mesh) -> None:
    """What the runtime does for checkpointing: each expert block becomes a Shard(0) DTensor."""
    for name in ("w_gate_up", "w_down"):
        local = getattr(moe.experts, name)
        dt = DTensor.from_local(local.detach(), mesh, [Shard(0)], run_check=False)
        setattr(moe.experts, name, torch.nn.Parameter(dt))


def _reference(cfg, suppress, chunks, targets, aux_only=False):
    """Unsharded MoE on each chunk separately; the gradients of the summed losses."""
    moe = _moe(cfg, suppress)
    outs, auxes, xgrads, counts = [], [], [], []
    for x, t in zip(chunks, targets):
        x = x.clone().requires_grad_()
        out, aux = moe(x)
        (aux if aux_only else (out * t).sum() + aux).backward()
        outs.append(out.detach())
        auxes.append(aux.detach())
        xgrads.append(x.grad)
        with torch.no_grad():
            ids = moe.route(x)[3]
        counts.append(torch.bincount(ids.reshape(-1), minlength=cfg.num_experts))
    return outs, auxes, xgrads, counts, _grads(moe)


def _check_replicated_and_expert_grads(moe: MoE, ref_grads, cfg) -> None:
    """Router / shared-expert grads summed over all ranks equal the reference; each rank's
    expert block, placed into a full-size zero tensor and summed over all ranks, equals the
    reference expert grads (this also sums the EP replicas when ep < world)."""
    per_rank = cfg.num_experts // moe.ep_size
    block = slice(moe.ep_rank * per_rank, (moe.ep_rank + 1) * per_rank)
    for name, grad in _grads(moe).items():
        if name.startswith("experts."):
            full = torch.zeros_like(ref_grads[name])
            full[block] = grad
            grad = full
            # Every expert block is held by world/ep ranks, each with its own part of the tokens.
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------- dispatch
def _check_dispatch_roundtrip(rank: int, world: int) -> None:
    """Rows tagged (expert, source, index) arrive grouped by local expert, then by source, and
    ``combine`` returns them (and their gradients) in the original order."""
    num_experts, ep = 8, world
    per_rank = num_experts // ep
    all_counts = []
    for src in range(world):
        c = torch.randint(0, 3, (num_experts,), generator=torch.Generator().manual_seed(10 + src))
        all_counts.append(c * 0 if src == 2 else c)  # rank 2 sends nothing
    all_counts[0][::per_rank] = 0  # rank 0 sends nothing to the first expert of each EP rank

    def rows(src):
        ids = torch.repeat_interleave(torch.arange(num_experts), all_counts[src])
        return torch.stack([ids.float(), torch.full_like(ids, src).float(), torch.arange(ids.numel()).float()], 1)

    x_sorted = rows(rank).requires_grad_()
    x_local, local_counts, handle = expert_parallel.dispatch(x_sorted, all_counts[rank], None)
    expected = []
    for e in range(rank * per_rank, (rank + 1) * per_rank):
        for src in range(world):
            r = rows(src)
            expected.append(r[r[:, 0] == e])
    assert torch.equal(x_local, torch.cat(expected))
    assert local_counts == [sum(int(c[e]) for c in all_counts) for e in range(rank * per_rank, (rank + 1) * per_rank)]

    back = expert_parallel.combine(x_local * 2.0, handle)
    assert torch.equal(back, x_sorted.detach() * 2.0)
    w = torch.randn(back.shape, generator=torch.Generator().manual_seed(rank))
    (back * w).sum().backward()
    assert torch.equal(x_sorted.grad, 2.0 * w)


# ---------------------------------------------------------------------------------- EP cases
def _check_ep_case(rank, world, cfg, ep, sizes, suppress_on, expect_empty_rank_expert, dtensor=False):
    """One EP configuration: outputs, aux, input grads on this rank's tokens; summed grads.
    ``dtensor``: the expert blocks are DTensor shards over the (world-sized) EP mesh."""
    suppress = bool(suppress_on)
    xs, ts = _batch(sizes, suppress_on)
    ref_out, ref_aux, ref_xgrad, ref_counts, ref_grads = _reference(cfg, suppress, xs, ts)
    # The scenario must really happen, or the check would be toothless.
    for r, e in expect_empty_rank_expert:
        assert ref_counts[r][e] == 0 and sizes[r] > 0, (r, e, ref_counts[r])

    groups = [dist.new_group(list(range(g, g + ep))) for g in range(0, world, ep)]  # all ranks create all
    moe = _moe(cfg, suppress)
    moe.enable_expert_parallel(groups[rank // ep], rank % ep, ep)
    assert moe.experts.w_gate_up.shape[0] == cfg.num_experts // ep
    if dtensor:
        _as_dtensor_shards(moe, init_device_mesh("cpu", (ep,)))
    x = xs[rank].clone().requires_grad_()
    out, aux = moe(x)
    ((out * ts[rank]).sum() + aux).backward()

    torch.testing.assert_close(out, ref_out[rank], **TOL)
    torch.testing.assert_close(aux, ref_aux[rank], **TOL)
    torch.testing.assert_close(x.grad, ref_xgrad[rank], **TOL)
    assert moe.experts.w_gate_up.grad is not None and moe.experts.w_down.grad is not None
    _check_replicated_and_expert_grads(moe, ref_grads, cfg)


def _ep_worker(rank: int, world: int) -> None:
    _check_dispatch_roundtrip(rank, world)
    # ep=4, 8 experts, shared expert: rank 2 has no tokens; rank 0 never routes to expert 0.
    _check_ep_case(rank, world, _config(8, shared=True), ep=4, sizes=[7, 5, 0, 9], suppress_on=[0],
                   expect_empty_rank_expert=[(0, 0)])
    # ep=4, 4 experts: nobody routes to expert 0, so EP rank 0 receives zero rows overall.
    _check_ep_case(rank, world, _config(4, shared=False), ep=4, sizes=[6, 4, 5, 3], suppress_on=[0, 1, 2, 3],
                   expect_empty_rank_expert=[(0, 0), (1, 0), (2, 0), (3, 0)], dtensor=True)
    # ep=2 twice ([0, 1] and [2, 3]), expert blocks replicated over the two EP groups.
    _check_ep_case(rank, world, _config(4, shared=True), ep=2, sizes=[6, 4, 8, 3], suppress_on=[3],
                   expect_empty_rank_expert=[(3, 0)])


# ---------------------------------------------------------------------------------- token groups
def _token_group_worker(rank: int, world: int) -> None:
    """Micro-batch A is split over ranks [0, 1], micro-batch B over [2, 3] (CP/SP peers)."""
    cfg = _config(8, shared=True, aux=0.1, z=0.01)  # large coefficients: the aux grads matter
    sizes = [5, 7, 6, 0]  # rank 3 holds no tokens of B
    xs, ts = _batch(sizes, suppress_on=[])
    mbs = [(0, 1), (2, 3)]
    mb_x = [torch.cat([xs[a], xs[b]]) for a, b in mbs]
    mb_t = [torch.cat([ts[a], ts[b]]) for a, b in mbs]
    pairs = [dist.new_group(list(p)) for p in mbs]
    mine = rank // 2
    lo = sum(sizes[: rank]) - sum(sizes[: 2 * mine])  # my rows inside my micro-batch
    rows = slice(lo, lo + sizes[rank])

    # (ep, EP group): none; all four ranks (EP spans both micro-batches); the token group itself.
    for ep, ep_group in [(1, None), (4, dist.group.WORLD), (2, pairs[mine])]:
        for aux_only in (True, False):
            ref_out, ref_aux, _, _, ref_grads = _reference(cfg, False, mb_x, mb_t, aux_only=aux_only)
            moe = _moe(cfg, False)
            if ep > 1:
                moe.enable_expert_parallel(ep_group, rank % ep, ep)
            moe.set_token_group(pairs[mine])
            # Two padding rows (masked out) after the real ones: routed, but not in the statistics.
            x = torch.cat([xs[rank], torch.randn(2, H, generator=torch.Generator().manual_seed(rank))])
            mask = torch.arange(x.shape[0]) < sizes[rank]
            out, aux = moe(x, mask)
            out = out[: sizes[rank]]
            (aux if aux_only else (out * ts[rank]).sum() + aux).backward()

            # Each rank reports the micro-batch's aux loss divided by the group size ...
            torch.testing.assert_close(aux, ref_aux[mine] / 2, **TOL)
            if not aux_only:
                torch.testing.assert_close(out, ref_out[mine][rows], **TOL)
            # ... and the gradients summed over all ranks are the single-process ones.
            _check_replicated_and_expert_grads(moe, ref_grads, cfg)

    # Without the token group, each rank's aux loss is that of its own tokens only: differs.
    moe = _moe(cfg, False)
    _, aux = moe(xs[rank])
    if rank in (0, 1):
        _, ref_aux, *_ = _reference(cfg, False, mb_x, mb_t)
        assert not torch.allclose(aux, ref_aux[mine] / 2, **TOL)


def _worker(rank: int, world: int) -> None:
    _ep_worker(rank, world)
    _token_group_worker(rank, world)


def test_expert_parallel_and_token_groups_match_single_process():
    # One spawn for all cases: starting four ranks costs more than the checks themselves.
    run_ranks(_worker, 4, timeout_s=120)


# ---------------------------------------------------------------------------------- token mask
def test_token_mask_leaves_padding_out_of_the_aux_loss():
    cfg = _config(4, shared=True, aux=0.1, z=0.01)
    xs, _ = _batch([9, 4], suppress_on=[])
    padded = torch.cat([xs[0], 5.0 * xs[1]])  # padding that would shift the statistics
    mask = torch.arange(13) < 9
    ref, ours = _moe(cfg, False), _moe(cfg, False)
    out_ref, aux_ref = ref(xs[0])
    out, aux = ours(padded[None], mask[None])  # [1, T] with a [1, T] mask, as the decoder passes it
    torch.testing.assert_close(out[0, :9], out_ref, **TOL)
    torch.testing.assert_close(aux, aux_ref, **TOL)
    assert not torch.allclose(ours(padded)[1], aux_ref, **TOL)  # unmasked padding does change it
    aux_ref.backward()
    aux.backward()
    torch.testing.assert_close(ours.router.weight.grad, ref.router.weight.grad, **TOL)


# ---------------------------------------------------------------------------------- errors
def test_ep_size_must_divide_num_experts():
    moe = MoE(_config(6, shared=False))
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by ep_size=4"):
        moe.enable_expert_parallel(None, 0, 4)
    with pytest.raises(ValueError, match=r"ep_rank=3 must be in 0..1"):
        moe.enable_expert_parallel(None, 3, 2)
    with pytest.raises(ValueError, match=r"ep_size=2 needs the EP process group"):
        moe.enable_expert_parallel(None, 0, 2)
    assert moe.experts.w_gate_up.shape[0] == 6  # nothing was sliced by the failed calls
