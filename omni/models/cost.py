"""The data plane's cost model from the model itself (forward FLOPs, attention vs. linear).
A media item's n is its LLM placeholders (output rows), whatever its encoder tokens.

``dataloading`` never imports the model: the recipes compute the coefficients here and hand
the plain numbers to the planner. All terms are forward FLOPs, so LLM and encoder costs add up
in one unit; training multiplies both by about 3, which does not change the balance.
"""
from __future__ import annotations

from dataloading.plan.cost import CostModel
from omni.models.llm.decoder import Decoder
from omni.models.multimodal import OmniModel


def llm_cost_coefficients(llm: Decoder) -> tuple[float, float]:
    """(alpha, beta) with cost(L) = alpha*L^2 + beta*L for one causal document of L tokens:
    QK^T and AV take 2*L^2*heads*head_dim FLOPs each per layer, halved by the causal mask;
    every token multiplies through the active parameters (2 FLOPs per MAC)."""
    c = llm.config
    alpha = 2.0 * c.num_layers * c.num_heads * c.resolved_head_dim()
    beta = 2.0 * llm.num_active_params()
    return alpha, beta


def default_cost_model(model: OmniModel) -> CostModel:
    alpha, beta = llm_cost_coefficients(model.llm)
    encoders = {}
    for modality, enc in model.encoders.items():
        a, b = enc.cost_coefficients()
        # Per LLM placeholder (n counts an item's output rows everywhere: the data plane's
        # index, the planners): an encoder that emits k = tokens_per_row tokens per row
        # (spatial merge) runs k*n tokens, alpha (k n)^2 + beta k n. The projector maps each row
        # into the LLM width: linear in n.
        k = enc.tokens_per_row
        proj = sum(p.numel() for p in model.projectors[modality].parameters() if p.dim() > 1)
        encoders[modality] = (float(a) * k * k, float(b) * k + 2.0 * proj)
    return CostModel(alpha, beta, encoders)
