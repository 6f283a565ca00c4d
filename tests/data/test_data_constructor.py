import numpy as np
import pytest
import torch

from dataloading.construct.batch import IGNORE_INDEX
from dataloading.construct.constructor import SampleConstructor, pack
from dataloading.construct.held_out import EvalSet
from dataloading.errors import DataError, ProblemCounter
from dataloading.formats.tokenizer import ByteTokenizer
from dataloading.index.shards import SourceReader, write_shards
from dataloading.index.source_index import load_index
from dataloading.plan.sample_length import estimate_tokens

TOK = ByteTokenizer()
IMG, AUD = TOK.placeholder_ids["image"], TOK.placeholder_ids["audio"]


@pytest.fixture(scope="module")
def reader(tmp_path_factory, media_bytes):
    png, wav = media_bytes
    samples = [
        {"__key__": "lm", "txt": "hello"},
        {"__key__": "img", "txt": "<image>\nwhat?", "png": png(16, 24), "response.txt": "a cat"},
        {"__key__": "mix", "txt": "<audio> and <image>", "0.wav": wav(480), "1.png": png(8, 16)},
        {"__key__": "bad", "txt": "<image><image>", "png": png(8, 8)},
        {"__key__": "wrongmod", "txt": "<audio>", "png": png(8, 8)},
        {"__key__": "corrupt", "txt": "<image>", "png": b"\x89PNG not really"},
    ] + [{"__key__": f"t{i}", "txt": "x" * (3 + 5 * i)} for i in range(12)]
    folder = tmp_path_factory.mktemp("constructor")
    write_shards(samples, folder, "c", samples_per_shard=100)
    return SourceReader("t", folder, {s["__key__"]: ("c-000000.tar", i) for i, s in enumerate(samples)})


def make(reader, processors, budget=64, on_error="skip", **kw):
    return SampleConstructor({"t": reader}, TOK, processors, budget, ProblemCounter(on_error, **kw))


def b(text):
    return list(text.encode())


def test_language_modelling_labels(reader, processors):
    (mb,) = make(reader, processors).build(["t/lm"])
    ids = [TOK.bos_id, *b("hello"), TOK.eos_id]
    assert mb.input_ids.tolist() == ids
    assert mb.labels.tolist() == ids[1:] + [IGNORE_INDEX]
    assert mb.position_ids.tolist() == list(range(7)) and mb.cu_seqlens.tolist() == [0, 7]
    assert mb.cu_seqlens.dtype == torch.int32 and mb.sample_ids == ["t/lm"] and mb.media == {}


def test_response_labels_and_image_positions(reader, processors):
    (mb,) = make(reader, processors).build(["t/img"])
    prompt = [TOK.bos_id] + [IMG] * 6 + b("\nwhat?")  # 16x24 image -> 2x3 patches of 8
    ids = prompt + b("a cat") + [TOK.eos_id]
    assert mb.input_ids.tolist() == ids
    expected = [IGNORE_INDEX] * (len(prompt) - 1) + b("a cat") + [TOK.eos_id, IGNORE_INDEX]
    assert mb.labels.tolist() == expected
    img = mb.media["image"]
    assert img.positions.tolist() == list(range(1, 7))
    assert img.sizes.tolist() == [[2, 3]] and img.num_tokens.tolist() == [6]
    assert img.features.shape == (6, 8 * 8 * 3)


def test_mixed_media_in_placeholder_order(reader, processors):
    (mb,) = make(reader, processors).build(["t/mix"])
    ids = [TOK.bos_id] + [AUD] * 3 + b(" and ") + [IMG] * 2 + [TOK.eos_id]  # 480 samples -> 3 frames
    assert mb.input_ids.tolist() == ids
    # no loss where the target is a placeholder; loss on the text after media and on eos
    ig = IGNORE_INDEX
    assert mb.labels.tolist() == [ig, ig, ig] + b(" and ") + [ig, ig, TOK.eos_id, ig]
    assert mb.media["audio"].positions.tolist() == [1, 2, 3]
    assert mb.media["image"].positions.tolist() == [9, 10]


def test_packing_respects_budget_and_offsets(reader, processors):
    ids = ["t/img", "t/mix", "t/lm"] + [f"t/t{i}" for i in range(12)]
    mbs = make(reader, processors, budget=64).build(ids)
    assert sorted(s for mb in mbs for s in mb.sample_ids) == sorted(ids)
    lengths = []
    for mb in mbs:
        assert mb.num_tokens <= 64
        cu = mb.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == mb.num_tokens
        for start, end in zip(cu, cu[1:]):
            assert mb.position_ids[start:end].tolist() == list(range(end - start))
            assert mb.input_ids[start].item() == TOK.bos_id and mb.input_ids[end - 1].item() == TOK.eos_id
            assert mb.labels[end - 1].item() == IGNORE_INDEX  # never predict across samples
            lengths.append(end - start)
        for modality, ph in (("image", IMG), ("audio", AUD)):
            where = torch.nonzero(mb.input_ids == ph).flatten().tolist()
            got = mb.media[modality].positions.tolist() if modality in mb.media else []
            assert got == where
            if modality in mb.media:
                assert int(mb.media[modality].num_tokens.sum()) == len(where)
    assert len(mbs) == -(-sum(lengths) // 64)  # these lengths pack perfectly with first-fit decreasing


def test_first_fit_decreasing():
    class S:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    bins = pack([S(n) for n in (3, 7, 5, 5, 2, 8)], 10)
    assert [[len(s) for s in b] for b in bins] == [[8, 2], [7, 3], [5, 5]]


def test_over_budget_is_a_clear_error(reader, processors):
    with pytest.raises(DataError) as info:
        make(reader, processors, budget=10).build(["t/lm", "t/img"])
    assert str(info.value) == ("sample t/img needs 19 tokens but data.micro_batch_tokens=10; raise "
                               "data.micro_batch_tokens, lower the image patch budget, or set data.over_budget "
                               "(truncate, split, skip)")


def test_mismatched_placeholders_skip_and_stop(reader, processors):
    c = make(reader, processors, max_skip_fraction=1.0)
    mbs, met = c.build_with_problems(["t/lm", "t/bad", "t/wrongmod", "t/corrupt", "t/img"])
    assert sorted(s for mb in mbs for s in mb.sample_ids) == ["t/img", "t/lm"]
    assert met == {"placeholder_mismatch": 2, "corrupt_media": 1}
    assert c.problems.counts == met and c.problems.seen == 5
    with pytest.raises(DataError) as info:
        make(reader, processors, on_error="stop").build(["t/lm", "t/wrongmod"])
    msg = str(info.value)
    assert msg.startswith("sample t/wrongmod: text placeholders ['audio'] do not match media fields ['png']")
    assert "the i-th placeholder needs media field i" in msg


def test_too_many_skips_stop_the_run(reader, processors):
    c = make(reader, processors, max_skip_fraction=0.5, grace=0)
    with pytest.raises(DataError, match=r"too many bad samples: 2 skipped of 3 seen .*last: sample t/wrongmod"):
        c.build(["t/lm", "t/bad", "t/wrongmod"])


def test_missing_processor_is_a_config_error(reader, processors):
    c = SampleConstructor({"t": reader}, TOK, {"image": processors["image"]}, 64, ProblemCounter("skip"))
    with pytest.raises(DataError, match="has audio media but no audio processor"):
        c.build(["t/mix"])


def test_planner_estimate_is_exact_for_bytes(demo_dir, processors):
    for source in ("shapes", "tones", "text"):
        index = load_index(demo_dir / source)
        c = SampleConstructor({source: index.reader(source)}, TOK, processors, None)
        for meta in index.samples[:15]:
            real = len(c.tokenize(c.fetch(f"{source}/{meta.key}")))
            assert estimate_tokens(meta, TOK, processors) == real


def test_eval_set_prompts(demo_dir, processors):
    evals = EvalSet(demo_dir / "eval", TOK, processors)
    assert len(evals) == 64
    seen = 0
    for mb, expected in evals:
        assert (mb.labels == IGNORE_INDEX).all() and mb.input_ids[0].item() == TOK.bos_id
        assert TOK.eos_id not in mb.input_ids.tolist()
        assert expected.startswith("a ") and expected.endswith(("tone", "left", "right"))
        media = next(iter(mb.media.values()))
        assert np.array_equal(media.positions.numpy(),
                              np.nonzero(np.isin(mb.input_ids.numpy(), [IMG, AUD]))[0])
        seen += 1
    assert seen == 64


def test_eval_prompts_take_their_training_sources_options(demo_dir, processors, tmp_path):
    """A held-out sample of eval/shapes is prompted with the shapes source's chat template; one of
    eval/tones (no source of that name in this mixture, and the sources differ) as written."""
    from dataloading.construct.held_out import eval_options
    from dataloading.plan.mixture import load_mixture

    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - {{name: shapes, path: {demo_dir / 'shapes'}, weight: 1, "
                   f"chat_template: 'Q: {{prompt}} A:'}}\n  - {{name: text, path: {demo_dir / 'text'}, weight: 1}}\n")
    tok = ByteTokenizer()
    templated = EvalSet(demo_dir / "eval", tok, processors, options=eval_options(load_mixture(mix).sources))
    plain = EvalSet(demo_dir / "eval", tok, processors)
    seen = set()
    for (ours, _), (theirs, _), key in zip(templated, plain, templated.keys):
        group = templated.group(f"eval/{key}")
        seen.add(group)
        if group == "shapes":
            n = len(theirs.input_ids)
            assert ours.input_ids[:4].tolist() == [tok.bos_id, *b"Q: "]
            assert ours.input_ids[-3:].tolist() == list(b" A:") and len(ours.input_ids) == n + 6
        else:
            assert torch.equal(ours.input_ids, theirs.input_ids)
    assert seen == {"shapes", "tones"}
