import pytest

from dataloading.errors import DataError
from dataloading.formats.tokenizer import ByteTokenizer, load_tokenizer


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    assert tok.vocab_size == 272 and tok.vocab_size % 16 == 0
    ids = set([tok.pad_id, tok.bos_id, tok.eos_id, *tok.placeholder_ids.values()])
    assert len(ids) == 5 and all(256 <= i < tok.vocab_size for i in ids)
    text = "héllo wörld ✓ 123"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("ab") == [97, 98]


def test_byte_tokenizer_placeholders_are_single_ids():
    tok = ByteTokenizer()
    ids = tok.encode("<image>\nsee <audio>!")
    assert ids[0] == tok.placeholder_ids["image"]
    assert ids.count(tok.placeholder_ids["image"]) == 1 and ids.count(tok.placeholder_ids["audio"]) == 1
    assert len(ids) == 1 + len("\nsee ") + 1 + 1
    # decode skips specials (placeholders, bos, eos)
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == "\nsee !"


def test_load_tokenizer_byte_and_missing_dir(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DataError, match=r"no such directory.*'byte'"):
        load_tokenizer(tmp_path / "nope")


def test_hf_tokenizer_from_local_dir(tmp_path):
    tok = load_tokenizer(_hf_dir(tmp_path))
    img, aud = tok.placeholder_ids["image"], tok.placeholder_ids["audio"]
    assert len({img, aud}) == 2 and min(img, aud) >= 5 and tok.vocab_size == 7
    assert tok.encode("hello <image> world<audio>") == [1, img, 2, aud]
    assert tok.bos_id == 3 and tok.eos_id == 4 and tok.pad_id == 4  # no pad token: falls back to eos
    assert tok.decode([3, 1, img, 2, 4]) == "hello world"


def _hf_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<s>": 3, "</s>": 4}
    core = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="<s>",
                                                eos_token="</s>")
    fast.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_only_configured_modalities_get_placeholders(tmp_path):
    """A vision-only model got an `<audio>` token too, so its vocabulary was one larger than the
    user's tokenizer (issue 17)."""
    path = _hf_dir(tmp_path)
    tok = load_tokenizer(path, modalities=["image"])
    assert tok.vocab_size == 6 and list(tok.placeholder_ids) == ["image"]
    img = tok.placeholder_ids["image"]
    # <audio> is plain text for this model (here: unknown words), never a placeholder id.
    assert tok.encode("hello <image> world<audio>") == [1, img, 2, 0, 0, 0]
    assert load_tokenizer(path, modalities=[]).vocab_size == 5
    byte = load_tokenizer("byte", modalities=["image"])
    assert list(byte.placeholder_ids) == ["image"] and byte.vocab_size == 272  # ids reserved, table unchanged
    assert byte.encode("<audio>") == list(b"<audio>")


def _sample():
    return "hello <image> world <audio> hello"


@pytest.mark.parametrize("kind", ["byte", "hf"])
@pytest.mark.parametrize("modalities", [["image"], ["image", "audio"]])
def test_saved_tokenizer_round_trips(tmp_path, kind, modalities):
    from dataloading.formats.tokenizer import save_tokenizer

    spec = "byte" if kind == "byte" else _hf_dir(tmp_path)
    tok = load_tokenizer(spec, modalities=modalities)
    save_tokenizer(tok, tmp_path / "run" / "tokenizer")
    again = load_tokenizer(tmp_path / "run" / "tokenizer")  # as a user would: no modalities given
    assert type(again) is type(tok)
    assert again.encode(_sample()) == tok.encode(_sample())
    assert (again.vocab_size, again.placeholder_ids, again.bos_id, again.eos_id, again.pad_id) == \
        (tok.vocab_size, tok.placeholder_ids, tok.bos_id, tok.eos_id, tok.pad_id)
    assert again.decode(tok.encode(_sample())) == tok.decode(tok.encode(_sample()))


def test_the_byte_tokenizer_as_transformers_files_encodes_and_decodes_the_same(tmp_path):
    """What `omni export` writes beside a model trained with the byte tokenizer."""
    transformers = pytest.importorskip("transformers")
    ours = ByteTokenizer(["image"])
    ours.save_hf(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ["héllo wörld ✓ 123\n\t x", "  two  spaces ", "".join(map(chr, range(256))), "<image>\nWhat is it?"]:
        ids = ours.encode(text)
        assert theirs(text, add_special_tokens=False)["input_ids"] == ids
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    assert (theirs.pad_token_id, theirs.bos_token_id, theirs.eos_token_id) == (ours.pad_id, ours.bos_id, ours.eos_id)
    assert theirs.convert_tokens_to_ids("<image>") == ours.placeholder_ids["image"]


def test_a_family_writes_its_placeholders_with_its_own_tokens(tmp_path):
    """Qwen2-VL: <image> becomes <|vision_start|><|image_pad|><|vision_end|>; the chat template's
    own <|image_pad|> and <|video_pad|> become the image slot's one placeholder id; the choice is
    kept with a saved tokenizer; a vocabulary without the family's tokens is one line."""
    pytest.importorskip("transformers")
    from dataloading.formats.tokenizer import PlaceholderTokens
    from hf_family_helpers import QWEN_SPECIALS, byte_level_tokenizer

    byte_level_tokenizer(QWEN_SPECIALS, eos="<|im_end|>").save_pretrained(tmp_path / "qwen")
    frame = ("<|vision_start|>", "<|vision_end|>")
    family = {"image": PlaceholderTokens("<|image_pad|>", *frame), "video": PlaceholderTokens("<|video_pad|>", *frame)}
    tok = load_tokenizer(tmp_path / "qwen", modalities=["image"], family_tokens=family)
    start, end, pad = (256 + QWEN_SPECIALS.index(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    assert tok.placeholder_ids == {"image": pad} and tok.vocab_size == 256 + len(QWEN_SPECIALS)  # nothing added
    assert tok.encode("a<image>b") == [ord("a"), start, pad, end, ord("b")]
    assert tok.encode("<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>") == \
        [start, pad, end] * 2
    tok.save(tmp_path / "run")
    assert load_tokenizer(tmp_path / "run").encode("<image>") == [start, pad, end]
    byte_level_tokenizer(["<|endoftext|>"], eos="<|endoftext|>").save_pretrained(tmp_path / "plain")
    with pytest.raises(DataError, match=r"writes its image placeholder as <\|vision_start\|><\|image_pad\|>"
                                        r"<\|vision_end\|>, but '<\|image_pad\|>' is not in the vocabulary"):
        load_tokenizer(tmp_path / "plain", modalities=["image"], family_tokens=family)
