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

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from parallel.transfer import to_device
from omni.step.encoder_plan import piece_bounds  # the routing plan uses the same pieces
from omni.kernels.segment_attention import segment_attention
from omni.models.attention import PackedSegments

if TYPE_CHECKING:  # annotations only: base imports this module to run its layers
    from omni.models.encoders.base import EncoderAnchor


@dataclass
class _UlyssesItems:
    """The attention of a member's pieces over whole items (a ``TokenAttention``). ``doc`` is
    the item index of each local row and a separate id for all padding rows: attention is
    bidirectional, so padding that shared an item's id would be attended by its real tokens.
    ``plan``: the whole items' rows in item order after the all-to-all (made on the host from
    the sizes), attended as one varlen pack by ``packed`` (the encoder's own backend)."""

    doc: torch.Tensor  # int64 [1, T_loc]
    pos: torch.Tensor  # int64 [1, T_loc]; ignored by the non-causal mask, required by cp_attention
    group: Optional[dist.ProcessGroup]
    plan: object = None  # parallel.cp_attention.UlyssesPlan
    packed: Optional[PackedSegments] = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        from parallel.cp_attention import cp_attention

        local = None if self.packed is None else (lambda q, k, v, _lengths, _causal, s: self.packed.attend(q, k, v, s))
        return cp_attention(q, k, v, self.doc, self.pos, self.group, impl="ulysses", causal=False, scale=scale,
                            ulysses=self.plan, local_attention=local)


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
    sp, member = _size_and_rank(group)
    check_sequence_parallel(encoder, sp)
    out, tokens = _encode(encoder, features[:0], sizes[:0], features, sizes, group)
    g = encoder.tokens_per_row
    return out, [torch.arange(*piece_bounds(n, sp, member, g), dtype=torch.int64, device=out.device) for n in tokens]


def encode_chunk(
    encoder: EncoderAnchor,
    features: torch.Tensor,
    sizes: torch.Tensor,
    long_features: Optional[torch.Tensor] = None,
    long_sizes: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """One rank's share of an encoder chunk in a single pass through the layers: short items
    (``features`` / ``sizes``) encoded whole, and this member's pieces of the long items
    (``long_*``, the same full items on every member of the SP group ``group``).

    Returns the short items' output rows (item after item), then this member's rows of the
    long items (item after item, the :func:`piece_bounds` ranges). Short and long tokens go
    through each layer together: local attention inside each short item, Ulysses attention
    for the long pieces. So whatever the mix, and with no items at all, every call runs each
    layer exactly once: under FSDP every encoder rank then gathers the same layers the same
    number of times (their all-gathers pair up). An encoder with ``forward`` only runs it on
    the short items (it has no long ones: the plan never splits its items).
    """
    return _encode(encoder, features, sizes, long_features, long_sizes, group)[0]


def _encode(encoder, features, sizes, long_features, long_sizes, group) -> Tuple[torch.Tensor, List[int]]:
    """``encode_chunk``, plus the long items' token counts."""
    has_long = long_sizes is not None and long_sizes.shape[0] > 0
    if not getattr(encoder, "supports_sequence_parallel", False):
        if has_long:
            check_sequence_parallel(encoder, 1)  # raises: names the encoder and the fix
        return encoder.forward(features, sizes), []
    xs, tokens = encoder.embed_inputs(features, sizes)
    sp, member = _size_and_rank(group) if has_long else (1, 0)
    long_tokens: List[int] = []
    if has_long:
        xl, long_tokens = encoder.embed_inputs(long_features, long_sizes)
    if sp == 1:  # nothing to split over: long items are whole items too
        if has_long:
            xs, tokens = torch.cat([xs, xl]), tokens + long_tokens
        x = _layer_input(encoder, xs)
        return encoder.finish(encoder.encode_tokens(x, encoder.item_attention(tokens, xs.device))), long_tokens
    check_sequence_parallel(encoder, sp)
    short = encoder.item_attention(tokens, xs.device)
    src, dst, doc, pos, t_loc, plan, packed = _local_layout(
        long_tokens, sp, member, xl.device, encoder.tokens_per_row,
        short.backend if isinstance(short, PackedSegments) else "sdpa")
    pieces = xl.new_zeros(t_loc, xl.shape[1]).index_copy(0, dst, xl.index_select(0, src))
    n_short = xs.shape[0]
    attention = _ShortAndLong(n_short, short, _UlyssesItems(doc[None], pos[None], group, plan, packed))
    out = encoder.finish(encoder.encode_tokens(_layer_input(encoder, torch.cat([xs, pieces])), attention))
    return torch.cat([out[:n_short], out[n_short:].index_select(0, dst)]), long_tokens


@dataclass
class _ShortAndLong:
    """Attention over a row of ``n_short`` tokens of whole items (``short``) followed by this
    member's pieces of long items (Ulysses)."""

    n_short: int
    short: object  # segment ids [n_short] or None (PyTorch path), or PackedSegments (varlen kernels)
    long: _UlyssesItems

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        n = self.n_short
        qs, ks, vs = q[:, :, :n], k[:, :, :n], v[:, :, :n]
        if isinstance(self.short, PackedSegments):
            short = self.short.attend(qs, ks, vs, scale)
        else:
            seg = None if self.short is None else self.short[None]
            short = segment_attention(qs, ks, vs, seg, causal=False, scale=scale)
        return torch.cat([short, self.long.attend(q[:, :, n:], k[:, :, n:], v[:, :, n:], scale)], dim=2)


def _layer_input(encoder: EncoderAnchor, x: torch.Tensor) -> torch.Tensor:
    """The layers' input, requiring a gradient whenever the encoder trains — also on a rank
    without items (its front-end output is a constant then) or with a frozen front-end. FSDP
    reduces a unit's gradients when the gradient of its input is computed, or, for an input
    that needs none, at the very end of backward: every rank must take the same path, or
    their reduce-scatters come in different orders."""
    if torch.is_grad_enabled() and not x.requires_grad and any(p.requires_grad for p in encoder.parameters()):
        return x.detach().requires_grad_()
    return x


def _size_and_rank(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _local_layout(tokens: Sequence[int], sp: int, member: int, device: torch.device, granule: int, backend: str):
    """Where this member's real rows come from and go, the mask inputs of its rows, and Ulysses'
    view of the whole items (``granule``: the encoder's tokens per output row; pieces are whole
    groups of them; ``backend``: the encoder's attention backend). Every member's rows, in member
    order as the all-to-all gathers them, sorted into items (padding rows last, one segment of
    their own) are attended as one varlen pack. Built on the host from the sizes, moved in one
    batched copy.

    Returns (src: rows of the full token states, dst: their local rows, doc and pos per local
    row, T_loc, the UlyssesPlan, the items as PackedSegments)."""
    from parallel.cp_attention import UlyssesPlan, plan_ulysses

    layouts = [_host_layout(tokens, sp, m, granule) for m in range(sp)]
    src, dst, doc, pos, t_loc = layouts[member]
    full = torch.cat([layout[2] for layout in layouts])[None]
    plan = plan_ulysses(full, torch.zeros_like(full), causal=False)
    packed = PackedSegments.from_lengths(list(plan.lengths), None, False, backend)
    src, dst, doc, pos, order, inverse, ids, cu = to_device(
        [src, dst, doc, pos, plan.order, plan.inverse, packed.ids, packed.cu_seqlens], device)
    return (src, dst, doc, pos, t_loc, UlyssesPlan(order, inverse, plan.lengths),
            replace(packed, ids=ids, cu_seqlens=cu))


def _host_layout(tokens: Sequence[int], sp: int, member: int, granule: int):
    """One member's rows on the host: (src, dst, doc, pos, T_loc), as ``_local_layout`` returns them."""
    src, dst, doc, pos = [], [], [], []
    start, t_loc = 0, 0
    pad_doc = len(tokens)  # one id past the items: padding attends only padding
    for i, n in enumerate(tokens):
        c = -(-(n // granule) // sp) * granule
        a, b = piece_bounds(n, sp, member, granule)
        src.append(torch.arange(start + a, start + b))
        dst.append(torch.arange(t_loc, t_loc + b - a))
        item_doc = torch.full((c,), pad_doc, dtype=torch.int64)
        item_doc[: b - a] = i
        doc.append(item_doc)
        pos.append(torch.arange(member * c, (member + 1) * c))
        start += n
        t_loc += c
    return (*(torch.cat(parts).to(torch.int64) for parts in (src, dst, doc, pos)), t_loc)
