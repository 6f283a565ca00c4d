"""Pure-PyTorch references of every kernel in ``omni.kernels``: what the tests compare them
with, and what runs on the CPU. Written for clarity, not speed (loops over documents)."""
from __future__ import annotations

import torch


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Each document on its own, with explicit softmax (q [T, H_q, D], k/v [T, H_kv, D])."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    out = []
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qd = q[a:b].transpose(0, 1)  # [H, L, D]
        kd = k[a:b].transpose(0, 1).repeat_interleave(group, 0)
        vd = v[a:b].transpose(0, 1).repeat_interleave(group, 0)
        scores = qd @ kd.transpose(1, 2) * scale
        if causal:
            n = b - a
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        out.append((scores.softmax(-1) @ vd).transpose(0, 1))
    return torch.cat(out) if out else q.new_zeros(q.shape)


def segment_costs_reference(cu_seqlens: torch.Tensor, alpha: float, beta: float, pack_ids: torch.Tensor,
                            n_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per segment alpha*L^2 + beta*L, per pack the sum over its segments), fp64; ``pack_ids``:
    the pack of every segment. Integer alpha/beta give exact integer sums."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.float64)
    per = alpha * lengths * lengths + beta * lengths
    totals = torch.zeros(n_packs, dtype=torch.float64, device=lengths.device)
    return per, totals.index_add_(0, pack_ids.to(torch.int64), per)


def greedy_assign_reference(costs: torch.Tensor, n_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LPT: items sorted by cost, heaviest first (ties: lower index first), each to the least
    loaded bin (ties: lowest bin). Returns (bin per item, load per bin)."""
    order = sorted(range(costs.numel()), key=lambda i: (-float(costs[i]), i))
    loads = [0.0] * n_bins
    assign = [0] * costs.numel()
    for i in order:
        b = min(range(n_bins), key=lambda j: (loads[j], j))
        assign[i] = b
        loads[b] += float(costs[i])
    return (torch.tensor(assign, dtype=torch.int64, device=costs.device),
            torch.tensor(loads, dtype=torch.float64, device=costs.device))


def route_rows_reference(positions: torch.Tensor, local_len: int, cp_size: int, tp_size: int,
                         chunk_lens: torch.Tensor | None = None, doc_starts: torch.Tensor | None = None):
    """Where each placeholder position of a packed row lives under the LLM layout: (rank among
    cp_size x tp_size, TP innermost: rank = cp_rank * tp_size + tp_rank; local position on that
    rank). Under CP every document of the (padded) row, starting at ``doc_starts[d]``, is cut
    into 2*cp_size chunks of ``chunk_lens[d]`` tokens (the zig-zag slicing of
    ``dataloading.construct.context_parallel``): CP rank r holds chunks r and 2*cp-1-r of every document,
    side by side, in document order. Then TP cuts the rank's row of ``local_len`` tokens (the
    whole row without CP) into tp_size equal shards."""
    shard = local_len // tp_size
    out_rank, out_pos = [], []
    for p in positions.tolist():
        cp_rank, local = 0, p
        if cp_size > 1:
            d = max(i for i, s in enumerate(doc_starts.tolist()) if s <= p)
            c = int(chunk_lens[d])
            within = p - int(doc_starts[d])
            chunk = within // c
            first = chunk < cp_size
            cp_rank = chunk if first else 2 * cp_size - 1 - chunk
            local = int(2 * chunk_lens[:d].sum()) + (0 if first else c) + within % c
        out_rank.append(cp_rank * tp_size + local // shard)
        out_pos.append(local % shard)
    return (torch.tensor(out_rank, dtype=torch.int64, device=positions.device),
            torch.tensor(out_pos, dtype=torch.int64, device=positions.device))


def send_maps_reference(dest_rank: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows with destination ranks: (the rows in send order, grouped by rank and stable
    inside a rank; the count per rank) — what a variable-split all-to-all sends."""
    order = sorted(range(dest_rank.numel()), key=lambda i: (int(dest_rank[i]), i))
    counts = torch.bincount(dest_rank.to(torch.int64), minlength=world)
    return torch.tensor(order, dtype=torch.int64, device=dest_rank.device), counts


def scatter_rows_reference(embeds: torch.Tensor, rows: torch.Tensor, row_index: torch.Tensor,
                           positions: torch.Tensor) -> torch.Tensor:
    """``embeds`` [T, H] with ``rows[row_index[i]]`` written at ``positions[i]`` (out of place)."""
    return embeds.index_copy(0, positions, rows.index_select(0, row_index).to(embeds.dtype))
