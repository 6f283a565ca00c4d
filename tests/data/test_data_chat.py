"""Conversations (messages.json): rendering by the tokenizer's chat template and assistant-only
loss masks, checked against transformers' own ``return_assistant_tokens_mask``, and carried
through packing and context-parallel slicing."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from dataloading.construct.batch import IGNORE_INDEX
from dataloading.construct.constructor import SampleConstructor, assemble
from dataloading.construct.context_parallel import _local_to_original, slice_for_cp
from dataloading.errors import DataError
from dataloading.formats.chat import BUILTIN_CHAT_TEMPLATES, render_segments
from dataloading.formats.sample import DecodedSample, decode_sample, parse_fields
from dataloading.formats.tokenizer import ByteTokenizer, HFTokenizer
from dataloading.plan.mixture import SourceOptions
from tests.data.fake_processors import FakeImageProcessor
from tests.hf_family_helpers import byte_level_tokenizer

# ChatML with transformers' {% generation %} blocks around each answer and its end of turn: the
# reference for which tokens are the assistant's.
CHATML_GENERATION = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "<image>What shape is this?"},
    {"role": "assistant", "content": "A red square."},
    {"role": "user", "content": "And its size?"},
    {"role": "assistant", "content": "Small,\nabout 8 pixels.  "},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You are welcome."},
]


def _trained_bpe(tmp_path):
    """A byte-level BPE *with merges* (trained here on chat-like text), ChatML specials and the
    reference template: a tokenization where pieces could merge across a boundary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = [json.dumps(CONVERSATION)] * 20 + ["assistant\nA red square. user\nsystem\n You are welcome."] * 20
    core.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_GENERATION
    fast.save_pretrained(tmp_path)
    return HFTokenizer(tmp_path, modalities=["image"])


@pytest.fixture(params=["no_merges", "bpe_merges"])
def chat_tokenizer(request, tmp_path):
    if request.param == "no_merges":
        tok = byte_level_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>",
                                   chat_template=CHATML_GENERATION)
        tok.save_pretrained(tmp_path)
        return HFTokenizer(tmp_path, modalities=["image"])
    return _trained_bpe(tmp_path)


def _png(h=16, w=24) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 200, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _sample(sample_id="src/0", messages=CONVERSATION, image=True) -> DecodedSample:
    fields = {"messages.json": json.dumps(messages).encode()}
    if image:
        fields["png"] = _png()
    return decode_sample(sample_id, fields)


def _constructor(tokenizer, assistant_loss="all") -> SampleConstructor:
    return SampleConstructor({}, tokenizer, {"image": FakeImageProcessor()}, None,
                             options={"src": SourceOptions(assistant_loss=assistant_loss)})


def _collapse(ids: np.ndarray, gets_loss: np.ndarray, placeholder: int):
    """One id per media item (transformers sees the placeholder once), with its loss flag."""
    keep = np.ones(len(ids), dtype=bool)
    keep[1:] = ~((ids[1:] == placeholder) & (ids[:-1] == placeholder))
    return ids[keep], gets_loss[keep]


def _gets_loss(t) -> np.ndarray:
    """Which tokens are predicted with a loss: token j is when labels[j - 1] is set."""
    out = np.zeros(len(t.ids), dtype=bool)
    out[1:] = t.labels[:-1] != IGNORE_INDEX
    return out


@pytest.mark.parametrize("assistant_loss", ["all", "last"])
def test_assistant_masks_equal_transformers_return_assistant_tokens_mask(chat_tokenizer, assistant_loss):
    t = _constructor(chat_tokenizer, assistant_loss).tokenize(_sample())
    ref = chat_tokenizer._tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                                  return_assistant_tokens_mask=True)
    ref_ids, ref_mask = np.asarray(ref["input_ids"]), np.asarray(ref["assistant_masks"], dtype=bool)
    if assistant_loss == "last":  # only the last answer's tokens: the mask's last run
        starts = np.flatnonzero(ref_mask & ~np.concatenate([[False], ref_mask[:-1]]))
        ref_mask[:starts[-1]] = False
    ids, mask = _collapse(t.ids, _gets_loss(t), chat_tokenizer.placeholder_ids["image"])
    assert ids.tolist() == ref_ids.tolist()  # the same rendering and tokens (no BOS for this tokenizer)
    assert mask.tolist() == ref_mask.tolist()
    assert ref_mask.sum() > 3
    # every label is the next token where it is set
    set_ = t.labels[:-1] != IGNORE_INDEX
    assert (t.labels[:-1][set_] == t.ids[1:][set_]).all()


def test_masks_survive_packing_and_cp_slicing(chat_tokenizer):
    c = _constructor(chat_tokenizer)
    other = CONVERSATION[3:5] + [{"role": "user", "content": "<image>again"}, {"role": "assistant", "content": "Yes."}]
    samples = [c.tokenize(_sample("src/0")), c.tokenize(_sample("src/1", other))]
    row = assemble(samples)
    whole = np.concatenate([s.labels for s in samples])
    assert row.labels.tolist() == whole.tolist()
    for rank in range(2):
        part = slice_for_cp(row, 2, rank, pad_id=0)
        orig = _local_to_original(part.cp)
        real = orig >= 0
        assert part.labels[real].tolist() == row.labels[orig[real]].tolist()
        assert (part.labels[~real] == IGNORE_INDEX).all()


def test_byte_tokenizer_with_the_plain_template_learns_to_end_its_turn():
    tok = ByteTokenizer(["image"], chat_template=BUILTIN_CHAT_TEMPLATES["plain"])
    t = _constructor(tok).tokenize(_sample())
    targets = t.ids[_gets_loss(t)]
    # each answer, then EOS (the template's end of turn), and nothing of the prompts
    assert (targets == tok.eos_id).sum() == 3
    text = tok.decode(targets)
    assert text == "A red square.Small,\nabout 8 pixels.  You are welcome."  # an answer's spaces are its own
    assert t.ids[0] == tok.bos_id


def test_held_out_prompt_is_the_turns_before_the_last_answer():
    tok = ByteTokenizer(["image"], chat_template=BUILTIN_CHAT_TEMPLATES["plain"])
    mb, expected = _constructor(tok).build_prompt(_sample())
    assert expected == "You are welcome."
    assert (mb.labels == IGNORE_INDEX).all()
    assert tok.decode(mb.input_ids.tolist()).endswith("<|user|>\nThanks\n<|assistant|>\n")


@pytest.mark.parametrize("messages, kind", [
    ([{"role": "user", "content": "hi"}], "no_assistant_turn"),
    ([{"role": "robot", "content": "hi"}], "bad_messages"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<image>"}], "placeholder_mismatch"),
    ("not a list", "bad_messages"),
])
def test_bad_conversations_are_one_line_sample_problems(messages, kind):
    with pytest.raises(DataError) as e:
        parse_fields("src/9", {"messages.json": json.dumps(messages).encode()})
    assert e.value.kind == kind and "src/9" in str(e.value) and "\n" not in str(e.value)


def test_placeholders_over_all_turns_must_match_the_media_fields():
    msgs = [{"role": "user", "content": "<image>a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "<image>c"}, {"role": "assistant", "content": "d"}]
    raw = parse_fields("s/1", {"messages.json": json.dumps(msgs).encode(), "0.png": _png(), "1.png": _png()})
    assert [m for m, _, _ in raw.media] == ["image", "image"]
    with pytest.raises(DataError, match="do not match media fields"):
        parse_fields("s/1", {"messages.json": json.dumps(msgs).encode(), "png": _png()})


def test_typed_content_parts_read_as_placeholders():
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a square"}]}]
    raw = parse_fields("s/2", {"messages.json": json.dumps(msgs).encode(), "png": _png()})
    assert raw.messages[0]["content"] == "<image>what?" and raw.messages[1]["content"] == "a square"


def test_a_template_that_rewrites_earlier_turns_is_refused(chat_tokenizer):
    # Drops every answer but the last (as reasoning templates drop earlier thoughts): turn 2's
    # text is not in the whole rendering, so where it is cannot be said.
    chat_tokenizer._tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(DataError) as e:
        render_segments(chat_tokenizer, "src/0", _sample().messages)
    assert e.value.kind == "chat_template" and "rewrites earlier turns" in str(e.value)


def test_a_tokenizer_without_a_template_is_a_config_error():
    with pytest.raises(DataError) as e:
        _constructor(ByteTokenizer(["image"])).tokenize(_sample())
    assert e.value.kind == "config" and "chat template" in str(e.value)


@pytest.mark.parametrize("template", ["hf", "byte_plain"])
def test_the_planner_counts_a_conversations_rendered_tokens_exactly(chat_tokenizer, tmp_path, template):
    from dataloading.demo import _chats, _rng
    from dataloading.index.shards import write_shards
    from dataloading.index.source_index import build_index
    from dataloading.plan.cost import CostModel
    from dataloading.plan.planner import SourceTable

    tok = chat_tokenizer if template == "hf" else ByteTokenizer(["image"], BUILTIN_CHAT_TEMPLATES["plain"])
    samples = list(_chats(_rng(0, "chat", 0), 12, lambda i: f"{i:03d}"))
    samples.append({"__key__": "plain", "txt": "<image>\nDescribe.", "png": _png(), "response.txt": "a square"})
    write_shards(samples, tmp_path / "src", "s", 5)
    index = build_index(tmp_path / "src", workers=2, progress=False)
    assert sum(m.chat for m in index.samples) == 12
    procs = {"image": FakeImageProcessor()}
    table = SourceTable("src", index, tok, procs, CostModel(), SourceOptions())
    c = SampleConstructor({"src": index.reader("src")}, tok, procs, None)
    for i, key in enumerate(table.keys):
        if key != "plain" or isinstance(tok, ByteTokenizer):  # a subword txt sample's length is estimated
            assert table.tokens[i] == len(c.tokenize(c.fetch(f"src/{key}"))), key
    # counted once: the second table reads the cache beside the index
    cached = list((tmp_path / "src").glob("omni_tokens.*.json"))
    assert len(cached) == 1
    again = SourceTable("src", index, tok, procs, CostModel(), SourceOptions())
    assert again.tokens.tolist() == table.tokens.tolist()


def test_split_pieces_keep_each_turns_labels(chat_tokenizer):
    whole = _constructor(chat_tokenizer).tokenize(_sample(image=False, messages=[
        {"role": "user", "content": "Count."}, {"role": "assistant", "content": "one two three four five six"},
        {"role": "user", "content": "More."}, {"role": "assistant", "content": "seven eight nine ten"}]))
    c = SampleConstructor({}, chat_tokenizer, {}, 16, options={"src": SourceOptions(over_budget="split")})
    pieces = [c.fit_budget(whole, k) for k in range(-(-len(whole) // 16))]
    assert len(pieces) > 2
    assert np.concatenate([p.labels for p in pieces]).tolist() == whole.labels.tolist()


def test_a_conversation_mixture_trains_and_evaluates_through_the_cli(demo_root, tmp_path):
    from tests.recipe_helpers import tiny_overrides, train

    run = tmp_path / "run"
    result = train(tiny_overrides(demo_root, run, **{
        "data.mixture": demo_root / "chat.yaml", "data.eval_dir": demo_root / "eval_chat",
        "data.chat_template": "plain", "encoders": "vision_only", "trainer.max_steps": 2,
        "trainer.eval_at_end": True, "trainer.eval_samples": 2, "trainer.max_new_tokens": 4}))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    assert len(steps) == 2 and all(np.isfinite(x["loss"]) and x["target_tokens"] > 0 for x in steps)
    assert any(x.get("event") == "eval" and x["num_samples"] == 2 for x in lines)
    # the run's tokenizer keeps the template: generation and export render prompts with it
    from dataloading.formats.tokenizer import load_tokenizer

    assert load_tokenizer(run / "tokenizer").chat_template == BUILTIN_CHAT_TEMPLATES["plain"]
    assert result.last_step == 2
