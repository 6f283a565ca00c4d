"""Context-parallel slicing of packed rows: zig-zag chunks per document, merge inverts it."""
import numpy as np
import pytest
import torch

from dataloading.construct.batch import IGNORE_INDEX, MicroBatch
from dataloading.construct.constructor import SampleConstructor, assemble, dummy_micro_batch
from dataloading.construct.context_parallel import local_documents, local_real_tokens, merge_cp_slices, slice_for_cp
from dataloading.formats.sample import DecodedSample
from dataloading.formats.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
PAD = TOK.pad_id
CP_SIZES = (1, 2, 4)


def _image(h, w, seed):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def rows(processors):
    """Real packed rows (tokenized by the constructor, packed by assemble) of uneven documents:
    some shorter than 2*cp for every cp tried, some with several images and audio."""
    c = SampleConstructor({}, TOK, processors, None)
    wave = (np.linspace(-0.5, 0.5, 480, dtype=np.float32), 16000)

    def tok(sid, text, media=(), response=None):
        return c.tokenize(DecodedSample(f"t/{sid}", text, response, list(media)))

    hi = tok("hi", "h")  # bos h eos: 3 tokens < 2*cp for cp 2 and 4
    one_img = tok("img", "<image>\ndescribe", [("image", _image(16, 24, 0))], response="a cat")
    two_img = tok("two", "<image> and <image>?", [("image", _image(8, 16, 1)), ("image", _image(24, 24, 2))])
    mixed = tok("mix", "<audio> then <image>", [("audio", wave), ("image", _image(16, 16, 3))], response="ok")
    text = tok("txt", "x" * 37)
    return {
        "text_only": assemble([text, hi, tok("t5", "abcde")]),
        "images": assemble([one_img, hi, two_img, text]),
        "mixed": assemble([hi, mixed, one_img, tok("t2", "ab")]),
        "single_short": assemble([hi]),
        "dummy": dummy_micro_batch(PAD),
    }


def reference_layout(mb: MicroBatch, cp: int, rank: int) -> tuple[list[int], list[int]]:
    """Per local token of ``rank``: (index in the unsliced row or -1 for padding, offset in the
    padded document), written the slow, obvious way."""
    orig, offsets = [], []
    cu = mb.cu_seqlens.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        n = end - start
        if cp == 1:
            orig += list(range(start, end))
            offsets += list(range(n))
            continue
        padded = -(-n // (2 * cp)) * 2 * cp
        c = padded // (2 * cp)
        doc = list(range(start, end)) + [-1] * (padded - n)
        for k in (rank, 2 * cp - 1 - rank):
            orig += doc[k * c:(k + 1) * c]
            offsets += list(range(k * c, (k + 1) * c))
    return orig, offsets


def all_cases():
    return [(name, cp) for name in ("text_only", "images", "mixed", "single_short", "dummy") for cp in CP_SIZES]


def assert_same_row(a: MicroBatch, b: MicroBatch):
    for f in ("input_ids", "position_ids", "labels", "cu_seqlens"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.tolist() == y.tolist(), f
    assert a.sample_ids == b.sample_ids
    assert a.media.keys() == b.media.keys()
    for m in a.media:
        x, y = a.media[m], b.media[m]
        assert x.positions.tolist() == y.positions.tolist(), m
        assert x.output_rows is None and y.output_rows is None
        assert torch.equal(x.features, y.features) and torch.equal(x.sizes, y.sizes)
        assert torch.equal(x.num_tokens, y.num_tokens)


@pytest.mark.parametrize("name,cp", all_cases())
def test_merge_gives_back_the_row(rows, name, cp):
    mb = rows[name]
    slices = [slice_for_cp(mb, cp, r, PAD) for r in range(cp)]
    assert_same_row(merge_cp_slices(slices[::-1]), mb)  # any order


@pytest.mark.parametrize("name,cp", all_cases())
def test_local_tokens_match_the_reference(rows, name, cp):
    mb = rows[name]
    doc_lens = mb.cu_seqlens.diff().tolist()
    sizes = set()
    for r in range(cp):
        s = slice_for_cp(mb, cp, r, PAD)
        orig, offsets = reference_layout(mb, cp, r)
        sizes.add(s.num_tokens)
        assert s.num_tokens == len(orig)
        want_ids = [PAD if o < 0 else mb.input_ids[o].item() for o in orig]
        want_labels = [IGNORE_INDEX if o < 0 else mb.labels[o].item() for o in orig]
        assert s.input_ids.tolist() == want_ids and s.labels.tolist() == want_labels
        # positions restart at 0 per document in assembled rows; padding continues them
        assert s.position_ids.tolist() == offsets
        chunks = [-(-n // (2 * cp)) for n in doc_lens] if cp > 1 else doc_lens
        local_lens = [2 * c for c in chunks] if cp > 1 else doc_lens
        assert s.cu_seqlens.dtype == torch.int32
        assert s.cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(local_lens)]).tolist()
        assert s.cp.cp_size == cp and s.cp.cp_rank == r and s.cp.chunk_lens.tolist() == chunks
        padded = [c * 2 * cp for c in chunks] if cp > 1 else doc_lens
        assert s.cp.global_cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(padded)]).tolist()
        assert s.cp.global_cu_seqlens.dtype == torch.int32 and s.cp.doc_lens.tolist() == doc_lens
        assert s.sample_ids == mb.sample_ids
    assert len(sizes) == 1  # every rank holds the same number of tokens


def _work(offsets) -> int:
    """Causal attention work: each query attends to (its offset + 1) keys of its document."""
    return sum(o + 1 for o in offsets)


@pytest.mark.parametrize("name,cp", [c for c in all_cases() if c[1] > 1])
def test_zigzag_balances_causal_work(rows, name, cp):
    mb = rows[name]
    zigzag = [_work(slice_for_cp(mb, cp, r, PAD).position_ids.tolist()) for r in range(cp)]
    # the contiguous split of each padded document, for comparison
    padded = slice_for_cp(mb, cp, 0, PAD).cp.global_cu_seqlens.diff().tolist()
    contiguous = [sum(_work(range(r * p // cp, (r + 1) * p // cp)) for p in padded) for r in range(cp)]
    max_chunk_work = max(_work(range(p - p // (2 * cp), p)) for p in padded)
    assert sum(zigzag) == sum(contiguous)
    assert max(zigzag) - min(zigzag) <= max_chunk_work
    assert max(zigzag) - min(zigzag) < max(contiguous) - min(contiguous)


@pytest.mark.parametrize("name,cp", [c for c in all_cases() if c[0] in ("images", "mixed")])
def test_output_rows_pick_the_local_placeholders(rows, name, cp):
    mb = rows[name]
    assert mb.media  # the row really has media
    seen = {m: [] for m in mb.media}
    for r in range(cp):
        s = slice_for_cp(mb, cp, r, PAD)
        orig, _ = reference_layout(mb, cp, r)
        local_of = {o: j for j, o in enumerate(orig) if o >= 0}
        for m, full in mb.media.items():
            got = s.media[m]
            want = [(i, local_of[p]) for i, p in enumerate(full.positions.tolist()) if p in local_of]
            if cp == 1:  # the identity: all rows, in order
                assert got.output_rows is None and got.positions.tolist() == full.positions.tolist()
                rows_ = list(range(full.positions.numel()))
            else:
                assert got.output_rows.dtype == torch.int64 and got.positions.dtype == torch.int64
                rows_ = got.output_rows.tolist()
            assert list(zip(rows_, got.positions.tolist())) == want
            assert (s.input_ids[got.positions] == TOK.placeholder_ids[m]).all()
            # every rank keeps all items: it runs (or receives) the whole encoder output
            assert torch.equal(got.features, full.features) and torch.equal(got.num_tokens, full.num_tokens)
            seen[m] += rows_
    for m, full in mb.media.items():  # each encoder row lands on exactly one rank
        assert sorted(seen[m]) == list(range(full.positions.numel()))


def _embed(mb: MicroBatch) -> torch.Tensor:
    """OmniModel.embed with fakes: text embedding = the token id, encoder output row i = 1000*(k+1) + i."""
    out = mb.input_ids.float()[:, None]
    for k, m in enumerate(sorted(mb.media)):
        x = mb.media[m]
        enc = (1000 * (k + 1) + torch.arange(int(x.num_tokens.sum()))).float()[:, None]
        if x.output_rows is not None:  # the two lines OmniModel.embed has
            enc = enc[x.output_rows]
        out = out.index_copy(0, x.positions, enc)
    return out


@pytest.mark.parametrize("name,cp", [c for c in all_cases() if c[0] in ("images", "mixed")])
def test_sliced_embedding_is_the_full_one_restricted(rows, name, cp):
    mb = rows[name]
    full = _embed(mb)
    for r in range(cp):
        s = slice_for_cp(mb, cp, r, PAD)
        orig = torch.tensor(reference_layout(mb, cp, r)[0])
        want = torch.where(orig[:, None] >= 0, full[orig.clamp(min=0)], torch.tensor([[float(PAD)]]))
        torch.testing.assert_close(_embed(s), want, rtol=0, atol=0)


def test_cp1_is_the_identity(rows):
    for mb in rows.values():
        s = slice_for_cp(mb, 1, 0, PAD)
        assert s.cp is not None and s.cp.cp_size == 1 and s.cp.cp_rank == 0
        assert torch.equal(s.cp.global_cu_seqlens, mb.cu_seqlens)
        assert_same_row(s, mb)


def test_padding_is_inert_and_continues_positions(rows):
    mb = rows["single_short"]  # bos h eos
    (s0, s1) = (slice_for_cp(mb, 2, r, PAD) for r in range(2))
    # padded to 4 tokens, chunks of 1: rank 0 gets offsets 0 and 3, rank 1 gets 1 and 2
    assert s0.input_ids.tolist() == [TOK.bos_id, PAD] and s0.position_ids.tolist() == [0, 3]
    assert s0.labels.tolist() == [mb.labels[0].item(), IGNORE_INDEX]
    assert s1.input_ids.tolist() == mb.input_ids[1:].tolist() and s1.position_ids.tolist() == [1, 2]


def test_to_carries_cp_info_and_output_rows(rows):
    s = slice_for_cp(rows["images"], 2, 1, PAD).to("cpu")
    assert s.cp is not None and s.cp.cp_rank == 1 and s.cp.cp_size == 2
    assert s.media["image"].output_rows is not None
    s = slice_for_cp(rows["images"], 1, 0, PAD).to("cpu")
    assert s.cp is not None and s.media["image"].output_rows is None


@pytest.mark.parametrize("cp_size,cp_rank", [(2, 2), (2, -1), (0, 0), (4, 7)])
def test_rank_out_of_range_names_the_arguments(rows, cp_size, cp_rank):
    with pytest.raises(ValueError, match=rf"cp_rank={cp_rank}.*cp_size={cp_size}"):
        slice_for_cp(rows["text_only"], cp_size, cp_rank, PAD)


def test_merge_refuses_incomplete_or_unsliced(rows):
    mb = rows["images"]
    with pytest.raises(ValueError, match="one slice per rank"):
        merge_cp_slices([slice_for_cp(mb, 4, r, PAD) for r in (0, 1, 3)])
    with pytest.raises(ValueError, match="slice_for_cp"):
        merge_cp_slices([mb])
    with pytest.raises(ValueError, match="already"):
        slice_for_cp(slice_for_cp(mb, 2, 0, PAD), 2, 0, PAD)


@pytest.mark.parametrize("name,cp", [c for c in all_cases() if c[1] > 1])
def test_local_documents_and_real_tokens_cover_the_row(rows, name, cp):
    """What ring/Ulysses attention and the MoE statistics read: each local token's document, and
    which tokens are real; step padding beyond the slice is a document of its own per rank."""
    mb = rows[name]
    n_docs = mb.cu_seqlens.numel() - 1
    real_total, pad_docs = 0, set()
    for r in range(cp):
        s = slice_for_cp(mb, cp, r, PAD)
        length = s.num_tokens + 3  # as if the step padded every row to a longer one
        doc = local_documents(s.cp, length)
        real = local_real_tokens(s.cp, length)
        assert doc.shape == real.shape == (length,)
        assert not real[-3:].any() and (doc[-3:] >= n_docs).all()
        pad_docs.add(int(doc[-1]))
        real_total += int(real.sum())
        # a real token's document is the one whose (padded) chunk holds it
        assert (doc[: s.num_tokens] < n_docs).all()
    assert real_total == mb.num_tokens
    assert len(pad_docs) == cp
    with pytest.raises(ValueError, match="shorter than"):
        local_documents(slice_for_cp(mb, cp, 0, PAD).cp, 0 if mb.num_tokens else -1)
