"""Positions of the tokens of a packed row beyond the per-document text index: Qwen2-VL's
multimodal rotary positions (M-RoPE), computed where rows are built, from each item's grid.
The model's rotary embedding (``omni.models.llm.rope``) rotates by them."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def video_with_audio(t: int, rows: int, cols: int, interval: float, n_audio: int,
                     chunk: float) -> tuple[list[tuple[bool, int]], np.ndarray, int]:
    """A video and its own audio track as Qwen2.5-Omni's thinker lays them out
    (``use_audio_in_video``): between an opening and a closing token, the tokens of the frames
    whose time (``frame x interval``, floored) falls in each ``chunk`` positions (2 seconds),
    then the audio tokens of those positions (one per position, 25 a second), chunk after chunk.

    Returns the runs ((is_video, count), in order), the span's positions [3, 2 + t*rows*cols +
    n_audio] relative to the position the opening token would take as text, and where text
    resumes after the span (relative too). As transformers' get_rope_index: the opening token
    shares the position of the token before it (the video's own opening token), the frames take
    (time, row, col) and the audio (i, i, i) from the next one, and the closing token shares its
    position with the token after it (the video's closing token), the largest position + 1."""
    times = np.floor(np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
    video = np.stack([np.repeat(times, rows * cols), np.tile(np.repeat(np.arange(rows), cols), t),
                      np.tile(np.arange(cols), t * rows)])
    audio = np.tile(np.arange(n_audio), (3, 1))

    def bounds(values: np.ndarray) -> list[tuple[int, int]]:
        # successive ranges of `chunk` positions (transformers' get_chunked_index)
        out, lo, k = [], 0, 1
        for i, v in enumerate(values):
            if v >= k * chunk:
                out.append((lo, i))
                lo, k = i, k + 1
        return out + [(lo, len(values))]

    v_chunks, a_chunks = bounds(video[0]), bounds(audio[0])
    runs, parts = [], [np.full((3, 1), -1)]
    for j in range(max(len(v_chunks), len(a_chunks))):
        for is_video, chunks, pos in ((True, v_chunks, video), (False, a_chunks, audio)):
            if j < len(chunks) and chunks[j][1] > chunks[j][0]:
                runs.append((is_video, chunks[j][1] - chunks[j][0]))
                parts.append(pos[:, chunks[j][0]:chunks[j][1]])
    top = int(max(video.max(initial=0), audio.max(initial=0))) + 1
    parts.append(np.full((3, 1), top))
    return runs, np.concatenate(parts, axis=1), top


def video_with_audio_by_time(t: int, rows: int, cols: int, interval: float,
                             n_audio: int) -> tuple[list[tuple[bool, int]], np.ndarray, int]:
    """A video and its own audio track as Qwen3-Omni's thinker lays them out (``use_audio_in_video``):
    between an opening and a closing token, the frames' tokens and the audio's merged by time,
    token by token (a frame's tokens at ``frame x interval``, audio token ``i`` at ``i``; a frame
    first on a tie). Returns what ``video_with_audio`` returns. As transformers' get_rope_index:
    the opening token takes the position after the video's own opening token, the frames (time,
    row, col) and the audio (i, i, i) count from the next one, and the closing token takes the
    largest + 1, the video's own closing token the one after."""
    if not float(interval).is_integer():
        raise ValueError(f"a temporal step of {interval} positions is not whole")
    times = np.repeat(np.arange(t, dtype=np.int64) * int(interval), rows * cols)
    video = np.stack([times, np.tile(np.repeat(np.arange(rows), cols), t), np.tile(np.arange(cols), t * rows)])
    audio = np.tile(np.arange(n_audio), (3, 1))
    # by time, frames before audio at a tie; each kind keeps its own order (a stable sort)
    kinds = np.concatenate([np.zeros(video.shape[1], np.int64), np.ones(n_audio, np.int64)])
    order = np.lexsort((kinds, np.concatenate([video[0], audio[0]])))
    merged = np.concatenate([video, audio], axis=1)[:, order]
    is_video = kinds[order] == 0
    edges = np.flatnonzero(np.diff(is_video.astype(np.int8))) + 1
    runs = [(bool(is_video[a]), int(b - a)) for a, b in zip(np.r_[0, edges], np.r_[edges, len(order)])]
    top = int(merged.max(initial=-1)) + 1
    rel = np.concatenate([np.zeros((3, 1), np.int64), merged + 1, np.full((3, 1), top + 1)], axis=1)
    return runs, rel, top + 2


def mrope_position_ids(length: int, items: Sequence[tuple], spans: Sequence[tuple] = ()) -> torch.Tensor:
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
    on its own, so adjacent items need no text between them. ``spans``: ``(start, relative
    positions [3, n], resume)`` of token spans laid out explicitly (``video_with_audio``), the
    positions relative to the one their first token would take as text."""
    out = torch.empty(3, length, dtype=torch.int64)
    pos = cursor = 0
    events = sorted([(item[0], 0, i) for i, item in enumerate(items)] + [(sp[0], 1, i) for i, sp in enumerate(spans)])
    for start, is_span, index in events:
        if start < cursor:
            raise ValueError(f"media item at {start} overlaps the previous one (ending at {cursor})")
        out[:, cursor:start] = torch.arange(start - cursor) + pos
        pos += start - cursor
        if is_span:
            _, rel, resume = spans[index]
            n = rel.shape[1]
            if start + n > length:
                raise ValueError(f"a span of {n} tokens at {start} runs past the document's {length} tokens")
            out[:, start:start + n] = torch.as_tensor(rel) + pos
            pos += resume
            cursor = start + n
            continue
        _, t, rows, cols, interval, *after = items[index]
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
