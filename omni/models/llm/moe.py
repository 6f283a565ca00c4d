"""Mixture-of-experts MLP (Mixtral / Qwen2-MoE): top-k softmax router, SwiGLU experts, optional
shared expert with a sigmoid gate. No capacity limit: every token reaches its k experts.

Weight layout (chosen for expert parallelism): the experts of a layer are two stacked 3D
parameters, ``experts.w_gate_up [E, 2I, H]`` (the gate rows first, then the up rows) and
``experts.w_down [E, H, I]``. EP shards both along dim 0; an EP rank then holds a contiguous block
of experts, and ``Experts.forward`` only needs the tokens already grouped by (local) expert plus
the per-expert counts. This is also transformers 5.x's in-memory layout (``gate_up_proj`` /
``down_proj``), so checkpoint conversion is a rename.

Compute is grouped, not dense: the (token, slot) pairs are sorted by expert id, each expert runs
one matmul over its contiguous slice (``F.grouped_mm``, which takes the slice ends on the device,
so a layer without EP reads nothing back), and the results are un-permuted and combined with the
router weights.

Expert parallelism (``MoE.enable_expert_parallel``): the layer keeps only its EP rank's block of
experts; the sorted rows go through ``parallel.expert_parallel.dispatch`` to the owning ranks, the
local experts run, and ``combine`` brings the results back in the sorted order. Router and shared
expert stay replicated. Parameter names do not change, only the expert dim-0 size.

Token groups (``MoE.set_token_group``): when one micro-batch's tokens are spread over several
ranks (context / sequence parallel peers), the load-balance and z-loss statistics are all-reduced
over those ranks so the aux loss is that of the whole micro-batch (see ``aux_loss``).
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn

from parallel import expert_parallel
from parallel.shared_cast import SharedCast

from .config import DecoderConfig
from .mlp import MLP


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # [N, E] logits


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts as stacked weights (see module doc)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Compute-dtype copies of the stacks, one shared by every micro-batch in flight (autocast's
        # own cache does not reach them: grouped_mm is not on its lists, slices are not leaves).
        self._casts = SharedCast()

    def forward(self, x_sorted: torch.Tensor, counts: Union[torch.Tensor, List[int]],
                host_counts: Optional[List[int]] = None) -> torch.Tensor:
        """x_sorted [M, H]: rows grouped by local expert, ``counts[e]`` rows for expert e (an int
        tensor on the rows' device, or a host list); ``host_counts``: the same on the host where
        it is known already (expert parallelism), for the per-expert loop."""
        # Under EP the runtime may wrap the expert blocks as DTensor shards (for checkpointing);
        # the compute only ever needs this rank's block, in the compute dtype.
        dt = _compute_dtype(x_sorted)
        w_gate_up, w_down = self._casts.get(self.w_gate_up, dt), self._casts.get(self.w_down, dt)
        if _grouped_mm_fits(x_sorted, w_gate_up, w_down):
            return _grouped_swiglu(x_sorted, w_gate_up, w_down, counts)
        # The per-expert loop needs the row counts on the host: with device counts this is a
        # device-to-host read (once per layer and micro-batch), where grouped_mm is missing.
        if host_counts is not None:
            counts = host_counts
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
        outs = []
        for e, xe in enumerate(torch.split(x_sorted, counts)):
            if xe.shape[0] == 0:
                continue
            gate, up = F.linear(xe, w_gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, w_down[e]))
        if not outs:
            # Run an expert on the empty input rather than returning fresh zeros: the result stays
            # in the autograd graph, so under EP a rank that received no rows still joins the
            # backward all-to-all (and its expert grads are zeros, not None).
            gate, up = F.linear(x_sorted, w_gate_up[0]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, w_down[0])
        return torch.cat(outs)


def _grouped_mm_fits(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` (where this torch has it) can run the experts: its operands' rows must be
    16-byte aligned. It takes the group ends as a device tensor, so no count leaves the device."""
    if not hasattr(F, "grouped_mm") or x.device.type not in ("cpu", "cuda"):
        return False
    dt = _compute_dtype(x)
    # On CUDA only the case torch's grouped kernel is built for (bf16 on sm90+, the GPU
    # default) is taken; other dtypes and GPUs keep the loop rather than rely on a fallback.
    if x.device.type == "cuda" and (dt != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9):
        return False
    elt = torch.finfo(dt).bits // 8
    return all((n * elt) % 16 == 0 for n in (x.shape[-1], w_gate_up.shape[1], w_down.shape[-1]))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # grouped_mm is not on autocast's lists: cast as autocast would cast a linear.
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _grouped_swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    counts: Union[torch.Tensor, List[int]]) -> torch.Tensor:
    """Every expert's SwiGLU in two grouped matmuls over the expert-sorted rows (the same
    products as the per-expert loop; an expert without rows is an empty group, and a rank
    without rows still gets zero expert gradients through the graph)."""
    dt = _compute_dtype(x)
    counts = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts)
    offs = torch.cumsum(counts.to(device=x.device), 0).to(torch.int32)  # group ends
    gate_up = F.grouped_mm(x.to(dt), w_gate_up.to(dt).transpose(-2, -1), offs=offs)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.grouped_mm((F.silu(gate) * up).contiguous(), w_down.to(dt).transpose(-2, -1), offs=offs)


class MoE(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        h = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.aux_loss_coef = config.router_aux_loss_coef
        self.z_loss_coef = config.router_z_loss_coef
        self.router = Router(h, config.num_experts)
        self.experts = Experts(config.num_experts, h, config.expert_intermediate_size())
        self.shared_expert: Optional[nn.Module] = None
        self.shared_expert_gate: Optional[nn.Linear] = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(h, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        # Process groups are passed in, never looked up globally (see DESIGN.md).
        self.ep_group: Optional[dist.ProcessGroup] = None
        self.ep_rank, self.ep_size = 0, 1
        self.token_group: Optional[dist.ProcessGroup] = None

    def enable_expert_parallel(self, group: Optional[dist.ProcessGroup], ep_rank: int, ep_size: int) -> None:
        """Keep only this EP rank's contiguous block of experts and dispatch tokens over ``group``.

        Call it after the weights are initialised or loaded (the block is a copy of the slice),
        and before the optimizer is built (the expert parameters are replaced). Every rank of the
        group must run every forward and backward of this layer, even with no tokens.
        """
        if self.ep_size != 1:
            raise RuntimeError(f"MoE: expert parallelism is already enabled (ep_size={self.ep_size}).")
        if ep_size < 1 or self.num_experts % ep_size != 0:
            raise ValueError(
                f"MoE: num_experts={self.num_experts} is not divisible by ep_size={ep_size}; "
                f"choose an EP size that divides {self.num_experts}."
            )
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"MoE: ep_rank={ep_rank} must be in 0..{ep_size - 1} (ep_size={ep_size}).")
        if ep_size > 1 and group is None:
            raise ValueError(f"MoE: ep_size={ep_size} needs the EP process group; pass it as `group`.")
        if group is not None and dist.get_world_size(group) != ep_size:
            raise ValueError(
                f"MoE: ep_size={ep_size} but the EP process group has {dist.get_world_size(group)} ranks; "
                "pass the group whose size is the EP size."
            )
        if ep_size == 1:
            return
        per_rank = self.num_experts // ep_size
        block = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        for name in ("w_gate_up", "w_down"):
            full = getattr(self.experts, name)
            setattr(self.experts, name, nn.Parameter(full.detach()[block].clone(), requires_grad=full.requires_grad))
        self.ep_group, self.ep_rank, self.ep_size = group, ep_rank, ep_size

    def set_token_group(self, group: Optional[dist.ProcessGroup]) -> None:
        """Ranks holding different parts of the same micro-batch's tokens (CP / SP peers); the
        aux loss is then computed over the whole micro-batch. ``None`` turns it off."""
        self.token_group = group

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> (logits [N, E], probs fp32 [N, E], top-k weights [N, k], top-k ids [N, k])."""
        logits = self.router(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights.to(x.dtype), ids

    def forward(self, hidden: torch.Tensor, token_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """hidden [..., H] -> (output [..., H], aux_loss scalar with the coefficients applied).

        ``token_mask`` (bool, shape ``hidden.shape[:-1]``) marks the real tokens: padding is still
        routed and computed (its output is ignored by the caller) but left out of the aux loss."""
        shape, dtype = hidden.shape, hidden.dtype
        x = hidden.reshape(-1, shape[-1])
        own = self.router.weight.dtype
        if x.dtype != own and not torch.is_autocast_enabled(x.device.type):
            # The layer is outside FSDP (its parameters keep their own dtype): a stream in
            # FSDP's bf16 with fp32 MoE weights and no autocast to reconcile them computes in
            # the weights' dtype and returns to the stream's.
            x = x.to(own)
        n = x.shape[0]
        logits, probs, weights, ids = self.route(x)

        # Group the N*k (token, slot) pairs by expert. A stable sort keeps token order inside an
        # expert, so results do not depend on the sort implementation.
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        # scatter_add rather than bincount: bincount reads the max id back to the host first.
        counts = flat_ids.new_zeros(self.num_experts).scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        x_sorted = x[order // self.top_k]
        if self.ep_group is not None:
            # An all-to-all takes its split sizes as host lists and the counts depend on the
            # data, so EP reads them back once per layer (one transfer, in ``dispatch``).
            x_local, local_counts, handle = expert_parallel.dispatch(x_sorted, counts, self.ep_group)
            y_sorted = expert_parallel.combine(self.experts(x_local, handle.local_counts, local_counts), handle)
        else:  # the counts stay on the device (grouped_mm)
            y_sorted = self.experts(x_sorted, counts)
        # Undo the permutation (a gather, so the backward is a scatter-add), then mix the k slots.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = y_sorted[inverse].view(n, self.top_k, y_sorted.shape[-1])  # explicit: n may be 0
        out = (y * weights.unsqueeze(-1)).sum(dim=1)

        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape).to(dtype), self.aux_loss(logits, probs, ids, token_mask)

    def aux_loss(self, logits: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor,
                 token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Switch/Mixtral load balancing E * sum_e f_e * P_e, plus the ST-MoE router z-loss.

        f_e: fraction of tokens whose top-k includes e (sums to k, as transformers counts it);
        P_e: mean router probability of e. Only P_e carries gradient. Per layer; the decoder sums
        over layers (transformers pools the counts of all layers before the product instead).
        Tokens outside ``token_mask`` count nowhere; a rank or group without tokens gets 0.

        With a token group, the counts and the token count (no grad), the probability sums and
        the z-loss sum (differentiable all-reduce) are summed over the group, so f, P and the
        z-loss are those of the whole micro-batch. Every rank of the group returns the loss
        divided by the group size: each adds it to its own loss, and the backward of the
        all-reduce sums the ranks' gradients, so the group together gets the single-process
        gradient exactly once.
        """
        n = ids.shape[0]
        keep = probs.new_ones(n) if token_mask is None else token_mask.reshape(n).to(probs.dtype)
        # A weighted scatter, not bincount(ids[mask]): no host sync for the boolean selection.
        counts = probs.new_zeros(self.num_experts).scatter_add_(
            0, ids.reshape(-1), keep[:, None].expand(n, self.top_k).reshape(-1))
        stats = torch.cat([counts, keep.sum()[None]])  # [E + 1]: counts per expert, tokens
        if token_mask is not None:
            probs = probs * keep[:, None]
        sums = probs.sum(dim=0)
        if self.z_loss_coef:
            z = torch.logsumexp(logits.float(), dim=-1).pow(2)
            sums = torch.cat([sums, (z * keep).sum()[None]])  # [E (+1)]: probability sums, z sum
        group_size = 1
        if self.token_group is not None:
            group_size = dist.get_world_size(self.token_group)
            dist.all_reduce(stats, group=self.token_group)
            sums = dist_fn.all_reduce(sums, group=self.token_group)  # backward: all-reduce of grads
        counts, tokens = stats[:-1], stats[-1].clamp_min(1.0)
        frac, mean_prob = counts / tokens, sums[: self.num_experts] / tokens
        loss = self.aux_loss_coef * self.num_experts * torch.sum(frac * mean_prob)
        if self.z_loss_coef:
            loss = loss + self.z_loss_coef * sums[-1] / tokens
        return loss / group_size
