"""Rotary position embeddings, with the scaling variants of HF checkpoints.

Every variant reduces to an inverse-frequency vector (head_dim / 2 entries) plus one scalar that
multiplies cos/sin ("attention scaling", YaRN's mscale). The formulas follow transformers'
``ROPE_INIT_FUNCTIONS`` operation by operation (same float32 ops in the same order) so that logits
match bit-for-bit-ish; ``tests/models/test_llm_hf_parity.py`` holds us to that.

Positions come from ``position_ids`` (not from the token index), so packed rows whose positions
restart at 0 for each document get per-document rotations.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from .config import DecoderConfig


def _base_inv_freq(base: float, dim: int, device=None) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))


def _default(c: DecoderConfig, p: dict, seq_len: Optional[int], device) -> Tuple[torch.Tensor, float]:
    return _base_inv_freq(c.rope_theta, c.resolved_head_dim(), device), 1.0


def _linear(c, p, seq_len, device):
    # Position interpolation: dividing positions by ``factor`` == dividing the frequencies.
    return _base_inv_freq(c.rope_theta, c.resolved_head_dim(), device) / p["factor"], 1.0


def _dynamic(c, p, seq_len, device):
    # NTK-aware: grow the base once the sequence is longer than the trained length; at or below
    # it the factor cancels and this is the default RoPE.
    dim, mpe, factor = c.resolved_head_dim(), c.max_position_embeddings, p["factor"]
    seq_len = mpe if seq_len is None else max(seq_len, mpe)
    base = c.rope_theta * ((factor * seq_len / mpe) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim, device), 1.0


def _llama3(c, p, seq_len, device):
    # Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend smoothly in between.
    inv_freq = _base_inv_freq(c.rope_theta, c.resolved_head_dim(), device)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p.get("original_max_position_embeddings", c.max_position_embeddings)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(c, p, seq_len, device):
    base, dim = c.rope_theta, c.resolved_head_dim()
    orig = p.get("original_max_position_embeddings", c.max_position_embeddings)
    factor = p.get("factor") or c.max_position_embeddings / orig
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention_factor is None:
        # DeepSeek-style configs give two mscales; their ratio is the cos/sin scale.
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits ``num_rotations`` times into the original length.
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = (1 - ramp).to(device=device, dtype=torch.float)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    inv_extrapolation = 1.0 / pos_freqs  # high frequencies: unchanged
    inv_interpolation = 1.0 / (factor * pos_freqs)  # low frequencies: interpolated
    inv_freq = inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight
    return inv_freq, attention_factor


def _longrope(c, p, seq_len, device):
    base, dim = c.rope_theta, c.resolved_head_dim()
    orig = p.get("original_max_position_embeddings", c.max_position_embeddings)
    factor = p.get("factor") or c.max_position_embeddings / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = p["long_factor"] if seq_len and seq_len > orig else p["short_factor"]
    ext = torch.tensor(ext, dtype=torch.float32, device=device)
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (ext * base**shape), attention_factor


_ROPE_FNS = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}


def rope_parameters(
    config: DecoderConfig, seq_len: Optional[int] = None, device=None
) -> Tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention_scaling) for ``config``'s RoPE type.

    ``seq_len`` matters only for "dynamic" and "longrope" (None = the trained length).
    """
    rope_type = config.rope_type()
    if rope_type not in _ROPE_FNS:
        raise ValueError(f"rope_type={rope_type!r} is not supported; use one of {tuple(_ROPE_FNS)}.")
    return _ROPE_FNS[rope_type](config, dict(config.rope_scaling or {}), seq_len, device)


def _length_threshold(config: DecoderConfig) -> Optional[int]:
    """Sequence length above which the frequencies depend on the length (None: never)."""
    rope_type = config.rope_type()
    if rope_type == "dynamic":
        return config.max_position_embeddings
    if rope_type == "longrope":
        return config.rope_scaling.get("original_max_position_embeddings", config.max_position_embeddings)
    return None


def mrope_components(section: Sequence[int], device=None, interleaved: bool = False) -> torch.Tensor:
    """M-RoPE (Qwen2-VL, arXiv:2409.12191 §2.1): which position row (0 temporal, 1 height,
    2 width) each of the head_dim / 2 frequencies rotates with: the first ``section[0]``
    frequencies the temporal row, the next ``section[1]`` the height row, the rest the width
    row; both halves of the head (``rotate_half`` pairs) use the same assignment.
    ``interleaved`` (Qwen3-VL): frequency j takes the height row when j % 3 == 1 and
    j < 3 x section[1], the width row when j % 3 == 2 and j < 3 x section[2], else the temporal
    row, so each axis spans low and high frequencies. Made on ``device`` from the section's
    numbers alone (no host data to copy)."""
    index = torch.arange(sum(int(x) for x in section), device=device)
    if interleaved:
        height = (index % 3 == 1) & (index < 3 * int(section[1]))
        width = (index % 3 == 2) & (index < 3 * int(section[2]))
        return height.long() + 2 * width.long()
    rows = torch.zeros_like(index)
    bound = 0
    for size in section[:-1]:
        bound += int(size)
        rows = rows + (index >= bound).to(rows.dtype)
    return rows


class RotaryEmbedding(nn.Module):
    """position_ids [B, T] -> (cos, sin) [B, T, head_dim], shared by all layers. With M-RoPE
    (``config.mrope_section``) position_ids may be [3, B, T]: each frequency takes the row of its
    section (``mrope_components``); [B, T] is then every row alike, which is 1-D RoPE."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.threshold = _length_threshold(config)
        inv_freq, self.attention_scaling = rope_parameters(config)
        # Not persistent: it is derived from the config, never part of a checkpoint.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_parameters(self, device=None) -> None:
        """Recompute the buffer, e.g. after building the model on the meta device."""
        device = self.inv_freq.device if device is None else device
        inv_freq, self.attention_scaling = rope_parameters(self.config, device=device)
        self.inv_freq = inv_freq

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = self.inv_freq, self.attention_scaling
        if self.threshold is not None:
            # Length-dependent types (dynamic NTK, LongRoPE) look at the longest position of the
            # batch, as transformers does. This costs a host sync, only for these types.
            seq_len = int(position_ids.max()) + 1
            if seq_len > self.threshold:
                inv_freq, scaling = rope_parameters(self.config, seq_len, position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float)
        if position_ids.dim() == 3:  # [3, B, T]: M-RoPE rows
            if self.config.mrope_section is None or position_ids.shape[0] != 3:
                raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} need model.mrope_section and "
                                 f"three rows (temporal, height, width)")
            rows = mrope_components(self.config.mrope_section, position_ids.device, self.config.mrope_interleaved)
            freqs = freqs.gather(0, rows.view(1, 1, 1, -1).expand(1, *freqs.shape[1:]))[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D], k [B, Hkv, T, D], cos/sin [B, T, D] (HF's half-split rotation layout).

    The rotated q and k keep the dtype of the projections that made them. Under bf16 autocast
    with fp32 weights the projections are bf16 while the tables follow the fp32 residual
    stream; type promotion would then hand attention fp32 q and k beside a bf16 v, which no
    varlen kernel accepts (the dtype policy: docs/parallelism.md, "Precision")."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_out = q * cos + _rotate_half(q) * sin
    k_out = k * cos + _rotate_half(k) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)
