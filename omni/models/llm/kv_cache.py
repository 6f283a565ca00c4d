"""The keys and values of earlier tokens, kept per layer so that generation computes each new
token once instead of recomputing the whole prefix (inference only; training never builds one).

Row ``b`` of the batch holds ``lengths[b]`` cached tokens in slots ``0 .. lengths[b] - 1`` of its
buffers; a forward of ``t`` new tokens writes them at slots ``lengths[b] .. lengths[b] + t - 1``
and each new token sees the keys at its own slot and before. Rows may hold different lengths
(prompts of different lengths): the slots past a row's length are hidden by the same rule, so
whatever they hold (zeros, or the keys of a right-padded prompt's padding that ``trim`` dropped
and the next tokens overwrite) never reaches a real token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KVCache:
    """Per-layer key and value buffers [B, kv_heads, max_len, head_dim] and the cached length of
    each row. The buffers are allocated by each layer's first write, with that layer's own head
    count, dtype and device (a tensor-parallel shard or an autocast dtype needs nothing here)."""

    def __init__(self, batch: int, max_len: int, device: torch.device | str):
        self.batch, self.max_len = batch, max_len
        self.device = torch.device(device)
        # On the host (so a forward slices the buffers without reading the device) and on the device.
        self.lengths: list[int] = [0] * batch
        self._lengths = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def step(self, t: int) -> "CacheStep":
        """What a forward of ``t`` new tokens per row needs: their slots and the attention mask."""
        width = max(self.lengths) + t
        if width > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens per row; {width} do not fit")
        slots = self.next_positions(t)  # [B, t]
        # A query sees the keys at its own slot and before: causal among the new tokens, and the
        # slots past a shorter row's length stay hidden.
        mask = torch.arange(width, device=self.device)[None, None, :] <= slots[:, :, None]  # [B, t, width]
        return CacheStep(self, slots, mask[:, None], width)

    def next_positions(self, t: int) -> torch.Tensor:
        """[B, t]: the slots of ``t`` new tokens per row, which are their 1-D positions when
        every cached token's position is its slot (a text prompt without padding)."""
        return self._lengths[:, None] + torch.arange(t, device=self.device)

    def advance(self, t: int) -> None:
        """Every row now caches its ``t`` tokens of the last forward."""
        self.lengths = [n + t for n in self.lengths]
        self._lengths += t

    def trim(self, lengths: list[int]) -> None:
        """Keep the first ``lengths[b]`` tokens of each row: after a right-padded prompt, its
        padding's keys are dropped (the next tokens overwrite them)."""
        if len(lengths) != self.batch or any(n > m for n, m in zip(lengths, self.lengths)):
            raise ValueError(f"cannot trim rows of {self.lengths} cached tokens to {lengths}")
        self.lengths = list(lengths)
        self._lengths.copy_(torch.tensor(lengths, dtype=torch.int64))


@dataclass
class CacheStep:
    """One forward through a cache: the new tokens' slots [B, t], the mask [B, 1, t, width] over
    the first ``width`` slots (the longest row's cached and new tokens)."""

    cache: KVCache
    slots: torch.Tensor
    mask: torch.Tensor
    width: int

    def layer(self, idx: int) -> "LayerCache":
        return LayerCache(self, idx)


@dataclass
class LayerCache:
    """One layer's view of a ``CacheStep``; ``Attention`` calls ``attend`` as it does on the
    other attention descriptions (``PackedSegments``, ``ContextParallelSegments``)."""

    step: CacheStep
    idx: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """q [B, Hq, t, D], k/v [B, Hkv, t, D] of the new tokens -> [B, Hq, t, D]; k and v are
        written into the cache first."""
        step, cache = self.step, self.step.cache
        if self.idx not in cache.keys:
            shape = (cache.batch, k.shape[1], cache.max_len, k.shape[3])
            cache.keys[self.idx] = k.new_zeros(shape)
            cache.values[self.idx] = v.new_zeros(shape)
        keys, values = cache.keys[self.idx], cache.values[self.idx]
        rows = torch.arange(cache.batch, device=k.device)[:, None]
        # Advanced indices on dims 0 and 2 around a slice put the indexed dims first: [B, t, H, D].
        keys[rows, :, step.slots] = k.transpose(1, 2).to(keys.dtype)
        values[rows, :, step.slots] = v.transpose(1, 2).to(values.dtype)
        k, v = keys[:, :, :step.width], values[:, :, :step.width]
        # Grouped KV heads are read in place, never repeated per query head: that would copy the
        # whole cache at every step, the group size times over.
        b, h, t, d = q.shape
        group = h // k.shape[1]
        if t == 1 and group > 1:
            # A decode step: a KV head's query heads become that many query rows (of one token,
            # under one mask) of the KV head, which every SDPA kernel takes. enable_gqa would not
            # do on CUDA: flash takes no mask and the memory-efficient kernel no grouped heads
            # (torch < 2.14), so SDPA would fall back to its math path, which repeats K and V.
            out = F.scaled_dot_product_attention(q.reshape(b, k.shape[1], group, d), k, v, attn_mask=step.mask,
                                                 scale=scale)
            return out.reshape(b, h, 1, d)
        if step.width == t:
            # A prompt into an empty cache: every row's mask is plain causal, so none is passed and
            # the flash kernels (which take grouped heads) apply.
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask, scale=scale, enable_gqa=group > 1)
