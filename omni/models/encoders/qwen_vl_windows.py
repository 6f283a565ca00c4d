"""Where each patch of a Qwen2-VL tower's packed items sits and which patches attend together,
computed on the host from the items' grids: the (row, col) of every patch in merge-window order
(its 2-D rotary position), and Qwen2.5-VL's attention windows with the order that makes each
window contiguous (so every layer attends over contiguous segments of host-known lengths).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:  # the config's home is the tower's module, which imports this one
    from omni.models.encoders.qwen_vl import QwenVisionConfig


def merge_order_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """(row, col) of each patch of a ``t x h x w`` grid in merge-window order: [t*h*w, 2]."""
    if h % merge or w % merge:
        raise ValueError(f"a {h}x{w} patch grid is not a whole number of {merge}x{merge} merge groups")
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    # merge-window order: group row, group col, then the merge x merge neighbours row-major
    rows = rows.permute(0, 2, 1, 3).reshape(-1)
    cols = cols.permute(0, 2, 1, 3).reshape(-1)
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def window_ids(t: int, h: int, w: int, merge: int, window: int) -> torch.Tensor:
    """Window of each patch (merge-window order), numbered from 0 within the item: windows of
    ``window`` x ``window`` merge groups, per frame, in raster order; edge windows are cut."""
    gh, gw = h // merge, w // merge
    n_w = -(-gw // window)
    per_frame = -(-gh // window) * n_w
    grow = torch.arange(gh).view(gh, 1).expand(gh, gw) // window
    gcol = torch.arange(gw).view(1, gw).expand(gh, gw) // window
    group_window = (grow * n_w + gcol).reshape(-1)  # per merge group, raster order
    patch_window = group_window.repeat_interleave(merge * merge)
    return torch.cat([patch_window + f * per_frame for f in range(t)])


def window_order(grids: Sequence[Tuple[int, int, int]],
                  c: QwenVisionConfig) -> Tuple[Optional[torch.Tensor], List[int], Optional[List[int]]]:
    """On the host, from the grids: the permutation that puts the packed patches (merge-window
    order) in window order (None when no layer uses windows: merge order already keeps every
    frame contiguous), and the segment lengths in that order: one per frame of each item (full
    attention) and one per window of each frame (Qwen2.5-VL's window layers; None without)."""
    frames = [h * w for t, h, w in grids for _ in range(t)]
    if not any(c.windowed(i) for i in range(c.num_hidden_layers)):
        return None, frames, None
    per_side = c.window_size // (c.spatial_merge * c.patch_size)
    ids, w0 = [], 0
    for t, h, w in grids:
        item = window_ids(t, h, w, c.spatial_merge, per_side)
        ids.append(item + w0)  # numbered across items: frame after frame, item after item
        w0 += int(item.max()) + 1 if item.numel() else 0
    ids = torch.cat(ids)
    order = torch.argsort(ids, stable=True)  # windows in order, each window's patches in merge order
    counts = torch.bincount(ids, minlength=w0)
    return order, frames, [int(n) for n in counts.tolist() if n]
