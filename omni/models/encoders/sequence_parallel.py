"""Long-item sequence parallelism for encoders (the "long" half of long-short SP).

A long media item (a big image, a long audio clip) is too costly for one rank: its attention
is quadratic in its token count. The ranks of a small SP group therefore share it: every member
runs the cheap front-end (``embed_inputs``) on the whole items, keeps one contiguous piece of
each item's tokens, and runs the transformer layers on its pieces only, with Ulysses attention
(``parallel.cp_attention``: all-to-all tokens -> heads, attention over the whole item, heads ->
tokens) in place of local attention. Then the per-token tail (``finish``).

Piece layout: item i of n_i tokens is padded to sp * c_i rows, c_i = ceil(n_i / sp); member m
holds rows [m*c_i, (m+1)*c_i) of it, of which the real ones are :func:`piece_bounds`. Every
member thus holds sum_i c_i rows, the equal length Ulysses needs.

Gradients: a member's output rows depend on its own piece of the front-end output only (plus
the other pieces through the attention collectives, whose backward is exact), so summing the
parameter gradients over the group (what a data-parallel all-reduce over the group does) gives
the single-process gradient of the whole items.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from dataloading.encoder_plan import piece_bounds  # the routing plan uses the same pieces
from omni.models.encoders.base import EncoderAnchor, packed_segment_ids


@dataclass
class _UlyssesItems:
    """The attention of a member's pieces over whole items (a ``TokenAttention``). ``doc`` is
    the item index of each local row and a separate id for all padding rows: attention is
    bidirectional, so padding that shared an item's id would be attended by its real tokens."""

    doc: torch.Tensor  # int64 [1, T_loc]
    pos: torch.Tensor  # int64 [1, T_loc]; ignored by the non-causal mask, required by cp_attention
    group: Optional[dist.ProcessGroup]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        from parallel.cp_attention import cp_attention

        return cp_attention(q, k, v, self.doc, self.pos, self.group, impl="ulysses", causal=False, scale=scale)


def check_sequence_parallel(encoder: EncoderAnchor, sp: int) -> None:
    """ValueError (one line: the encoder, the cause and the fix) when ``encoder`` cannot run
    :func:`encode_long_items` over ``sp`` ranks (an encoder without the forward steps cannot
    run it at all, not even at sp = 1)."""
    name = type(encoder).__name__
    if not getattr(encoder, "supports_sequence_parallel", False):
        raise ValueError(
            f"encoder {name} does not support sequence parallelism (supports_sequence_parallel is False); "
            f"set multiplex.encoder_sp=1 so its items are encoded whole, or implement "
            f"embed_inputs/encode_tokens/finish/attention_heads in {name}"
        )
    if sp > 1:
        heads = encoder.attention_heads()
        if heads % sp:
            raise ValueError(
                f"encoder {name} has {heads} attention heads, which do not split over an SP group of {sp} "
                f"ranks; choose multiplex.encoder_sp dividing {heads}"
            )


def encode_long_items(
    encoder: EncoderAnchor,
    features: torch.Tensor,
    sizes: torch.Tensor,
    group: Optional[dist.ProcessGroup],
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Encode items split over the SP group ``group``; this member's share of the output.

    Every member of ``group`` calls this with the same ``features`` / ``sizes`` (the full
    items, same order). ``group`` None means the default group when torch.distributed is
    initialised (as in ``cp_attention``) and a lone process (sp = 1) otherwise.

    Returns (rows [n_local, output_dim]: this member's real output rows, item after item;
    per item an int64 tensor of the item's token rows they are, the contiguous
    :func:`piece_bounds` range, possibly empty). The concatenation over members, item by item,
    equals ``encoder(features, sizes)``. Differentiable end to end; every member must run
    backward through its rows (even when it holds none): the collectives' backward pairs up.
    """
    if group is None and not (dist.is_available() and dist.is_initialized()):
        sp, member = 1, 0
    else:
        sp, member = dist.get_world_size(group), dist.get_rank(group)
    check_sequence_parallel(encoder, sp)
    x, tokens = encoder.embed_inputs(features, sizes)
    if not tokens:  # no items on any member, so no member enters the collectives
        return encoder.finish(x), []
    if sp == 1:  # nothing to split: whole items, local attention, no collectives (= forward)
        out = encoder.finish(encoder.encode_tokens(x, packed_segment_ids(tokens, x.device)))
        return out, [torch.arange(n, dtype=torch.int64, device=out.device) for n in tokens]
    src, dst, doc, pos, t_loc, bounds = _local_layout(tokens, sp, member, x.device)
    local = x.new_zeros(t_loc, x.shape[1]).index_copy(0, dst, x.index_select(0, src))
    attention = _UlyssesItems(doc[None], pos[None], group)
    out = encoder.finish(encoder.encode_tokens(local, attention)).index_select(0, dst)
    return out, [torch.arange(a, b, dtype=torch.int64, device=out.device) for a, b in bounds]


def _local_layout(tokens: Sequence[int], sp: int, member: int, device: torch.device):
    """Where this member's real rows come from and go, and the mask inputs of its rows.

    Returns (src: rows of the full token states, dst: their local rows, doc and pos per local
    row, T_loc, piece_bounds per item)."""
    src, dst, doc, pos, bounds = [], [], [], [], []
    start, t_loc = 0, 0
    pad_doc = len(tokens)  # one id past the items: padding attends only padding
    for i, n in enumerate(tokens):
        c = -(-n // sp)
        a, b = piece_bounds(n, sp, member)
        bounds.append((a, b))
        src.append(torch.arange(start + a, start + b))
        dst.append(torch.arange(t_loc, t_loc + b - a))
        item_doc = torch.full((c,), pad_doc, dtype=torch.int64)
        item_doc[: b - a] = i
        doc.append(item_doc)
        pos.append(torch.arange(member * c, (member + 1) * c))
        start += n
        t_loc += c
    as_dev = lambda parts: torch.cat(parts).to(dtype=torch.int64, device=device)
    return as_dev(src), as_dev(dst), as_dev(doc), as_dev(pos), t_loc, bounds
