"""Long-item encoder sequence parallelism equals the single-process encoder: output rows,
coverage of the rows by the members, and parameter gradients (summed over the group); also
with short items of each member's own in the same pass (``encode_chunk``)."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

# dist_helpers lives beside the parallel tests; spawned ranks inherit sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel"))
from dist_helpers import run_ranks  # noqa: E402
from omni.models.encoders.base import EncoderAnchor  # noqa: E402
from omni.models.encoders.blocks import packed_segment_ids  # noqa: E402
from omni.models.encoders.sequence_parallel import encode_chunk, encode_long_items, piece_bounds  # noqa: E402
from omni.models.encoders.siglip import SiglipEncoder, SiglipEncoderConfig
from omni.models.encoders.whisper import WhisperEncoder, WhisperEncoderConfig

SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8, max_patches=64)
WHISPER = dict(num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
               max_source_positions=32)
# Item sizes: token counts 35, 16, 3, 36 (SigLIP grids) and 32, 11, 3, 20 (Whisper: (frames+1)//2).
MIXED = {"siglip": [(5, 7), (4, 4), (1, 3), (6, 6)], "whisper": [(63,), (21,), (5,), (40,)]}
# One item smaller than sp: the last members hold no row at all.
TINY = {"siglip": [(1, 1)], "whisper": [(1,)]}


def _encoder(kind: str, heads: int = 4) -> EncoderAnchor:
    torch.manual_seed(0)  # identical weights on every rank
    if kind == "siglip":
        cfg = dict(SIGLIP, num_attention_heads=heads, hidden_size=8 * heads)
        return SiglipEncoder(SiglipEncoderConfig(**cfg))
    cfg = dict(WHISPER, encoder_attention_heads=heads, d_model=8 * heads)
    return WhisperEncoder(WhisperEncoderConfig(**cfg))


def _inputs(enc: EncoderAnchor, sizes_list, seed: int = 1):
    width = 2 if isinstance(enc, SiglipEncoder) else 1
    sizes = torch.tensor(sizes_list, dtype=torch.int64).reshape(len(sizes_list), width)
    feat_dim = enc.embeddings.patch_embedding.in_features if isinstance(enc, SiglipEncoder) else enc.config.num_mel_bins
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(enc.input_units(sizes)), feat_dim, generator=g), sizes


def _grads(enc: nn.Module) -> dict:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in enc.named_parameters() if p.requires_grad}


def _check_case(kind: str, sizes_list, rank: int, world: int) -> None:
    enc = _encoder(kind)
    features, sizes = _inputs(enc, sizes_list)
    ref = enc(features, sizes)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    (ref * w).sum().backward()
    ref_grads = _grads(enc)
    enc.zero_grad(set_to_none=True)

    out, rows = encode_long_items(enc, features, sizes, None)
    assert out.shape == (sum(r.numel() for r in rows), enc.output_dim)
    tokens = enc.embed_inputs(features, sizes)[1]
    offsets = torch.tensor([0, *tokens]).cumsum(0)[:-1]
    global_rows = torch.cat([off + r for off, r in zip(offsets.tolist(), rows)])
    torch.testing.assert_close(out, ref.detach()[global_rows], rtol=1e-5, atol=1e-5)
    for i, (n, r) in enumerate(zip(tokens, rows)):
        assert r.dtype == torch.int64
        a, b = piece_bounds(n, world, rank)
        assert r.tolist() == list(range(a, b)), (kind, i)

    # every row of every item is held by exactly one member
    gathered = [None] * world
    dist.all_gather_object(gathered, [r.tolist() for r in rows])
    for i, n in enumerate(tokens):
        held = sorted(x for member in gathered for x in member[i])
        assert held == list(range(n)), (kind, i, held)

    (out * w[global_rows]).sum().backward()
    grads = _grads(enc)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        dist.all_reduce(g)
        err = (g - ref_grads[name]).norm().item()
        # Some gradients are zero in exact arithmetic (k_proj.bias: softmax ignores a shift
        # shared by all keys; q_proj for a one-token item): compare those to fp32 noise, not to
        # their own (noise) norm.
        assert err <= 1e-5 * max(ref_grads[name].norm().item(), 1.0), (kind, name, err)


def _check_head_error(kind: str, world: int) -> None:
    enc = _encoder(kind, heads=3)
    features, sizes = _inputs(enc, MIXED[kind][:1])
    with pytest.raises(ValueError, match=rf"{type(enc).__name__} has 3 attention heads.*{world} ranks.*"
                                         r"multiplex\.encoder_sp dividing 3"):
        encode_long_items(enc, features, sizes, None)


def _short_items(kind: str, rank: int):
    """Each member's own short items; the last member has none (it still runs every layer)."""
    return [MIXED[kind][2], TINY[kind][0]][: max(0, 2 - rank)]


def _check_chunk(kind: str, rank: int, world: int, backend: str = "sdpa") -> None:
    """One pass with this member's short items (different per member, none on the last) and
    the shared long items: the short rows equal the plain encoder on them, the long rows are
    this member's pieces, and the gradients summed over members equal the single process's.
    ``backend``: the short items' attention (``triton``: the varlen kernel, interpreted)."""
    enc = _encoder(kind)
    reference_backend = enc.attn_backend
    long_f, long_s = _inputs(enc, MIXED[kind][:2], seed=3)
    weights = {}
    ref_grads = None
    for r in range(world):  # the reference: every member's short items and the long ones, whole
        short_f, short_s = _inputs(enc, _short_items(kind, r), seed=10 + r)
        ref_short = enc(short_f, short_s)
        w = torch.randn(ref_short.shape, generator=torch.Generator().manual_seed(20 + r))
        (ref_short * w).sum().backward()
        weights[r] = (short_f, short_s, ref_short.detach(), w)
    ref_long = enc(long_f, long_s)
    w_long = torch.randn(ref_long.shape, generator=torch.Generator().manual_seed(30))
    (ref_long * w_long).sum().backward()
    ref_grads = _grads(enc)
    enc.zero_grad(set_to_none=True)
    assert reference_backend == "auto"  # the reference ran the PyTorch path (CPU)
    enc.attn_backend = backend

    short_f, short_s, want_short, w = weights[rank]
    out = encode_chunk(enc, short_f, short_s, long_f, long_s, None)
    tokens = enc.embed_inputs(long_f, long_s)[1]
    offsets = torch.tensor([0, *tokens]).cumsum(0)[:-1].tolist()
    pieces = torch.cat([torch.arange(*piece_bounds(n, world, rank)) + off for n, off in zip(tokens, offsets)])
    n_short = want_short.shape[0]
    assert out.shape[0] == n_short + pieces.numel()
    torch.testing.assert_close(out[:n_short], want_short, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[n_short:], ref_long.detach()[pieces], rtol=1e-5, atol=1e-5)
    (out[:n_short] * w).sum().add((out[n_short:] * w_long[pieces]).sum()).backward()
    for name, g in _grads(enc).items():
        dist.all_reduce(g)
        err = (g - ref_grads[name]).norm().item()
        assert err <= 1e-5 * max(ref_grads[name].norm().item(), 1.0), (kind, name, err)


def _worker(rank: int, world: int) -> None:
    for kind in ("siglip", "whisper"):
        _check_case(kind, MIXED[kind], rank, world)
        _check_case(kind, TINY[kind], rank, world)
        _check_chunk(kind, rank, world)
        if world == 2:
            _check_chunk(kind, rank, world, backend="triton")
        _check_head_error(kind, world)


@pytest.mark.parametrize("world", [2, 4])
def test_long_items_equal_single_process(world):
    run_ranks(_worker, world, timeout_s=120)


# ------------------------------------------------------------------------ single process


def test_piece_bounds():
    assert [piece_bounds(35, 4, m) for m in range(4)] == [(0, 9), (9, 18), (18, 27), (27, 35)]
    assert [piece_bounds(3, 4, m) for m in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert [piece_bounds(5, 4, m) for m in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert piece_bounds(7, 1, 0) == (0, 7) and piece_bounds(0, 2, 1) == (0, 0)
    with pytest.raises(ValueError, match="0 <= member < sp"):
        piece_bounds(4, 2, 2)


@pytest.mark.parametrize("kind", ["siglip", "whisper"])
def test_forward_is_the_three_steps_bitwise(kind):
    enc = _encoder(kind)
    features, sizes = _inputs(enc, MIXED[kind])
    x, tokens = enc.embed_inputs(features, sizes)
    assert tokens == [35, 16, 3, 36] if kind == "siglip" else tokens == [32, 11, 3, 20]
    steps = enc.finish(enc.encode_tokens(x, packed_segment_ids(tokens, x.device)))
    assert torch.equal(enc(features, sizes), steps)
    assert enc.supports_sequence_parallel and enc.attention_heads() == 4
    empty = enc(features[:0], sizes[:0])
    assert empty.shape == (0, enc.output_dim)


@pytest.mark.parametrize("kind", ["siglip", "whisper"])
def test_sp1_without_process_group_is_forward(kind):
    enc = _encoder(kind)
    features, sizes = _inputs(enc, MIXED[kind])
    out, rows = encode_long_items(enc, features, sizes, None)
    assert torch.equal(out, enc(features, sizes))
    assert [r.tolist() for r in rows] == [list(range(n)) for n in enc.embed_inputs(features, sizes)[1]]
    out, rows = encode_long_items(enc, features[:0], sizes[:0], None)
    assert out.shape == (0, enc.output_dim) and rows == []


class _ForwardOnly(EncoderAnchor):
    """A plugin that implements only forward (as third-party plugins may)."""

    modality = "image"

    def __init__(self):
        super().__init__(None)
        self.output_dim = 4
        self.proj = nn.Linear(4, 4)

    def forward(self, features, sizes):
        return self.proj(features)


def test_plugin_without_steps_is_refused_clearly():
    enc = _ForwardOnly()
    assert not enc.supports_sequence_parallel
    assert enc(torch.ones(2, 4), torch.tensor([[2]])).shape == (2, 4)
    with pytest.raises(ValueError, match=r"_ForwardOnly does not support sequence parallelism.*encoder_sp=1"):
        encode_long_items(enc, torch.ones(2, 4), torch.tensor([[2]]), None)
    # The multiplexing runtime still slices its features per item (default: product of sizes).
    assert enc.input_units(torch.tensor([[2], [3]])) == [2, 3]
    with pytest.raises(NotImplementedError, match=r"_ForwardOnly \(image\) does not implement embed_inputs"):
        enc.embed_inputs(torch.ones(2, 4), torch.tensor([[2]]))
