"""Positions of the tokens of a packed row beyond the per-document text index: Qwen2-VL's
multimodal rotary positions (M-RoPE), computed where rows are built, from each item's grid.
The model's rotary embedding (``omni.models.llm.rope``) rotates by them."""
from __future__ import annotations

from typing import Sequence

import torch


def mrope_position_ids(length: int, items: Sequence[tuple]) -> torch.Tensor:
    """M-RoPE positions [3, length] (temporal, height, width) of one document of ``length``
    tokens whose media items are ``(start, t, rows, cols, time_interval[, after_largest])``: the
    item's first placeholder in the document, its grid of placeholders (t frames of rows x cols
    LLM tokens: a Qwen-VL item of h x w patches merged 2 x 2 has rows = h / 2), the temporal step
    between its frames (1 for an image; a video's ``tokens_per_second x seconds per temporal
    patch``) and where text resumes after it.

    As Qwen2-VL's ``get_rope_index`` (transformers 5.24): text runs count up by one in all three
    rows; an item's placeholders get (start + floor(frame x interval), start + row, start +
    col), start being the next text position; after it text continues at start + max(rows,
    cols), or with ``after_largest`` past the item's largest position, start + max(rows, cols,
    last frame's time + 1) (Qwen2.5-Omni's TMRoPE: the same for an image). Each item is placed
    on its own, so adjacent items need no text between them."""
    out = torch.empty(3, length, dtype=torch.int64)
    pos = cursor = 0
    for start, t, rows, cols, interval, *after in sorted(items):
        if start < cursor:
            raise ValueError(f"media item at {start} overlaps the previous one (ending at {cursor})")
        out[:, cursor:start] = torch.arange(start - cursor) + pos
        pos += start - cursor
        n = t * rows * cols
        if start + n > length:
            raise ValueError(f"a {t}x{rows}x{cols} item at {start} runs past the document's {length} tokens")
        frames = torch.arange(t)
        if interval != 1:  # float32, as the processor's seconds per temporal patch are
            frames = frames * torch.tensor(interval, dtype=torch.float32)
        out[0, start:start + n] = frames.long().repeat_interleave(rows * cols) + pos
        out[1, start:start + n] = torch.arange(rows).repeat_interleave(cols).repeat(t) + pos
        out[2, start:start + n] = torch.arange(cols).repeat(t * rows) + pos
        times = int(frames[-1]) + 1 if after and after[0] and t else 0
        pos += max(rows, cols, times)
        cursor = start + n
    out[:, cursor:] = torch.arange(length - cursor) + pos
    return out
