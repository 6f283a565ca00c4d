"""Mixture-of-experts MLP (Mixtral / Qwen2-MoE): top-k softmax router, SwiGLU experts, optional
shared expert with a sigmoid gate. No capacity limit: every token reaches its k experts.

Weight layout (chosen for expert parallelism): the experts of a layer are two stacked 3D
parameters, ``experts.w_gate_up [E, 2I, H]`` (the gate rows first, then the up rows) and
``experts.w_down [E, H, I]``. EP shards both along dim 0; an EP rank then holds a contiguous block
of experts, and ``Experts.forward`` only needs the tokens already grouped by (local) expert plus
the per-expert counts. This is also transformers 5.x's in-memory layout (``gate_up_proj`` /
``down_proj``), so checkpoint conversion is a rename.

Compute is grouped, not dense: the (token, slot) pairs are sorted by expert id, each expert runs
one matmul over its contiguous slice, and the results are un-permuted and combined with the router
weights. A grouped-GEMM kernel (or the EP all-to-all) slots in at ``Experts.forward``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import DecoderConfig


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

    def forward(self, x_sorted: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """x_sorted [M, H]: rows grouped by local expert, ``counts[e]`` rows for expert e."""
        outs = []
        for e, xe in enumerate(torch.split(x_sorted, counts)):
            if xe.shape[0] == 0:
                continue
            gate, up = F.linear(xe, self.w_gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, self.w_down[e]))
        if not outs:
            return x_sorted.new_zeros(0, self.w_down.shape[1])
        return torch.cat(outs)


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
            from .layers import MLP  # local import: layers imports this module

            self.shared_expert = MLP(h, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> (logits [N, E], probs fp32 [N, E], top-k weights [N, k], top-k ids [N, k])."""
        logits = self.router(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights.to(x.dtype), ids

    def forward(self, hidden: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """hidden [..., H] -> (output [..., H], aux_loss scalar with the coefficients applied)."""
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        n = x.shape[0]
        logits, probs, weights, ids = self.route(x)

        # Group the N*k (token, slot) pairs by expert. A stable sort keeps token order inside an
        # expert, so results do not depend on the sort implementation.
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        y_sorted = self.experts(x[order // self.top_k], counts.tolist())
        # Undo the permutation (a gather, so the backward is a scatter-add), then mix the k slots.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = y_sorted[inverse].view(n, self.top_k, -1)
        out = (y * weights.unsqueeze(-1)).sum(dim=1)

        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape), self.aux_loss(logits, probs, counts, n)

    def aux_loss(self, logits: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor, n: int) -> torch.Tensor:
        """Switch/Mixtral load balancing E * sum_e f_e * P_e, plus the ST-MoE router z-loss.

        f_e: fraction of tokens whose top-k includes e (sums to k, as transformers counts it);
        P_e: mean router probability of e. Only P_e carries gradient. Per layer; the decoder sums
        over layers (transformers pools the counts of all layers before the product instead).
        """
        frac = counts.to(probs.dtype) / max(n, 1)
        loss = self.aux_loss_coef * self.num_experts * torch.sum(frac * probs.mean(dim=0))
        if self.z_loss_coef:
            loss = loss + self.z_loss_coef * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        return loss
