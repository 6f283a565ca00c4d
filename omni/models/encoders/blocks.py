"""The building blocks the built-in encoders' layers share, so that no encoder carries its own
copy: activations by their transformers name, bidirectional self-attention over packed items
(segment ids, or a ``TokenAttention`` that attends across ranks), and the FLOP and
activation-memory formulas of a pre-norm transformer stack (what ``cost_coefficients`` and
``activation_bytes`` report).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Protocol, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from omni.kernels.segment_attention import segment_attention, segment_ids_from_cu_seqlens


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Activation by its transformers name (the subset encoders use)."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACTIVATIONS)}") from None


def packed_segment_ids(tokens_per_item: Sequence[int], device: torch.device) -> Optional[torch.Tensor]:
    """Segment id per token for packed items, or None when there is a single item (no mask)."""
    if len(tokens_per_item) <= 1:
        return None
    cu = torch.tensor([0, *tokens_per_item], dtype=torch.int64).cumsum(0)
    return segment_ids_from_cu_seqlens(cu, int(cu[-1])).to(device)


class TokenAttention(Protocol):
    """Stands in for segment ids when the tokens of an item are spread over several ranks
    (e.g. sequence parallelism): it computes the attention itself, collectives included."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q, k, v [1, H, T, D] (this rank's tokens) -> [1, H, T, D]; bidirectional."""
        ...


#: What encode_tokens and packed_self_attention take as ``attention``.
AttentionSpec = Union[torch.Tensor, None, TokenAttention]


def packed_self_attention(
    x: torch.Tensor,
    q_proj: nn.Linear,
    k_proj: nn.Linear,
    v_proj: nn.Linear,
    out_proj: nn.Linear,
    num_heads: int,
    attention: AttentionSpec,
    prescale_q: bool = False,
) -> torch.Tensor:
    """Bidirectional multi-head self-attention over packed tokens x [T, D].

    ``attention`` is segment ids [T] (tokens attend only within their segment; None: one
    segment) or a :class:`TokenAttention`, which then computes the attention. ``prescale_q``
    multiplies q by head_dim**-0.5 before the product (the order Whisper uses) instead of
    scaling the scores."""
    t, d = x.shape
    hd = d // num_heads
    q = q_proj(x).view(t, num_heads, hd).transpose(0, 1)[None]
    k = k_proj(x).view(t, num_heads, hd).transpose(0, 1)[None]
    v = v_proj(x).view(t, num_heads, hd).transpose(0, 1)[None]
    scale = None
    if prescale_q:
        q = q * hd**-0.5
        scale = 1.0
    if attention is None or isinstance(attention, torch.Tensor):
        seg = None if attention is None else attention[None]
        o = segment_attention(q, k, v, seg, causal=False, scale=scale)
    else:
        o = attention.attend(q, k, v, hd**-0.5 if scale is None else scale)
    return out_proj(o[0].transpose(0, 1).reshape(t, d))


def transformer_flops(num_layers: int, d: int, ffn: int) -> Tuple[float, float]:
    """(alpha, beta) of a pre-norm transformer stack: per layer 4*n^2*d for QK^T and AV,
    8*n*d^2 for the q/k/v/out projections, 4*n*d*ffn for the MLP (2 FLOPs per MAC)."""
    return float(4 * num_layers * d), float(num_layers * (8 * d * d + 4 * d * ffn))


def transformer_activation_bytes(num_layers: int, d: int, ffn: int, tokens: int, element_bytes: int,
                                 recompute: str = "none") -> float:
    """Activation bytes a pre-norm transformer stack saves for backward on ``tokens`` tokens,
    with memory-efficient attention (no n^2 score matrix kept): per layer and token about
    10*d values (the two norms' inputs, q, k, v, the attention output and its projection's
    input, the residuals) and 2*ffn (the MLP's hidden state before and after the activation).
    Under activation checkpointing (``recompute``, ``omni.models.recompute``): ``full`` keeps
    each layer's input (d), ``selective`` its input and the matmul and attention outputs (q, k,
    v, the attention output, o_proj's, fc1's and fc2's: 7*d + ffn with the input). Checked
    against what autograd actually saves in tests/models/test_encoder_memory.py."""
    per_token = {"none": 10 * d + 2 * ffn, "selective": 7 * d + ffn, "full": d}[recompute]
    return float(num_layers * tokens * per_token * element_bytes)
