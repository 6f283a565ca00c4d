"""Tokenizers: a protocol, a dependency-free byte tokenizer and a Hugging Face wrapper.

Placeholders (``<image>``, ``<audio>``) are always cut out of the text *before* the
underlying tokenizer sees it and become exactly one id each, so the data plane can count
and expand them without trusting a BPE merge table. Only the placeholders of the modalities the
model has encoders for are given ids (``modalities``): a vision-only model's vocabulary holds no
``<audio>``, so it is not larger than the user's tokenizer, and the text "<audio>" is plain text
to it.

A model family may write a placeholder with tokens of its own vocabulary (``PlaceholderTokens``):
Qwen2-VL's image is ``<|vision_start|><|image_pad|><|vision_end|>``, its ``<|image_pad|>``
repeated once per encoder output. A Hugging Face tokenizer given such a spec turns ``<image>``
into the three ids, and the family's own token, as a chat template writes it between its
markers, into the one placeholder id: data in Omni's format and prompts rendered by the
model's chat template then give the ids the family was trained with.

``save_tokenizer`` writes the tokenizer a run used into a folder that ``load_tokenizer`` reads
back with the same ids (``<run_dir>/tokenizer``).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from dataloading.errors import DataError
from dataloading.formats.media import MEDIA_PLACEHOLDERS, PLACEHOLDERS, encoder_modality
from dataloading.formats.modality import MODALITIES

_PLACEHOLDER_RE = re.compile("(" + "|".join(re.escape(p) for p in PLACEHOLDERS.values()) + ")")
_MODALITY_OF = {p: m for m, p in PLACEHOLDERS.items()}
# Written beside a saved tokenizer: which kind it is and which placeholders it has.
OMNI_TOKENIZER_FILE = "omni_tokenizer.json"


def _digest(parts) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# The files of a Hugging Face tokenizer (a model folder also holds weights, which are not hashed).
_TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                              "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                              "chat_template.json"})


def hashlib_file(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _modalities(modalities: Iterable[str] | None) -> list[str]:
    """The placeholder modalities to give ids (None: every known one), in PLACEHOLDERS order."""
    if modalities is None:
        return list(PLACEHOLDERS)
    unknown = sorted(set(modalities) - set(PLACEHOLDERS))
    if unknown:
        raise DataError(f"no placeholder is defined for modality {unknown[0]!r}; known: {list(PLACEHOLDERS)}",
                        kind="config")
    return [m for m in PLACEHOLDERS if m in set(modalities)]


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None  # None: the tokenizer has no BOS (e.g. Qwen2); nothing is prepended
    eos_id: int
    pad_id: int
    placeholder_ids: dict[str, int]  # modality -> id
    # Mean UTF-8 bytes per token, used only to *estimate* lengths for planning.
    bytes_per_token: float

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class PlaceholderTokens:
    """A modality's placeholder in a model family's vocabulary: ``token`` is repeated once per
    encoder output; ``before``/``after`` (may be empty) frame each item once."""

    token: str
    before: str = ""
    after: str = ""


def split_placeholders(text: str) -> list[str]:
    """``"a<image>b"`` -> ``["a", "<image>", "b"]`` (empty pieces dropped)."""
    return [p for p in _PLACEHOLDER_RE.split(text) if p]


def estimate_text_tokens(tokenizer: Tokenizer, n_bytes: int) -> int:
    """Token count of ``n_bytes`` of placeholder-free text (exact for ByteTokenizer)."""
    return int(math.ceil(n_bytes / tokenizer.bytes_per_token))


def encode_with_placeholders(
    text: str, placeholder_ids: dict[str, int], encode_piece: Callable[[str], Iterable[int]],
    expansions: Mapping[str, Sequence[int]] | None = None,
) -> list[int]:
    """Text -> ids, each placeholder of ``placeholder_ids`` (``<image>``, ``<audio>``) becoming its
    single id and the text between them (a placeholder of another modality included) going through
    the tokenizer's own ``encode_piece``. ``expansions``: pieces of text that become given ids
    instead (a family's framed placeholder, its own placeholder token)."""
    if not expansions:
        pieces = split_placeholders(text)
        expansions = {}
    else:
        keys = sorted(set(expansions) | {PLACEHOLDERS[m] for m in placeholder_ids}, key=len, reverse=True)
        pieces = [p for p in re.split("(" + "|".join(re.escape(k) for k in keys) + ")", text) if p]
    ids: list[int] = []
    for piece in pieces:
        modality = _MODALITY_OF.get(piece)
        if piece in expansions:
            ids.extend(expansions[piece])
        elif modality in placeholder_ids:
            ids.append(placeholder_ids[modality])
        else:
            ids.extend(encode_piece(piece))
    return ids


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then specials. Needs no files; used by the demo and tests.
    The placeholder ids are reserved whether or not their modality is used, so the vocabulary
    (272) is the same for every model; ``modalities`` selects which placeholders are recognised."""

    # The placeholders' ids are their declarations' ``byte_token_id`` (259, 260, ...): they follow
    # the three specials without a gap, as ``save_hf`` adds the specials in order.
    RESERVED = {m.name: m.byte_token_id for m in MODALITIES if m.byte_token_id is not None}
    SPECIALS = ("<pad>", "<bos>", "<eos>", *(MODALITIES[m].placeholder for m in sorted(RESERVED, key=RESERVED.get)))
    bytes_per_token = 1.0

    def __init__(self, modalities: Iterable[str] | None = None, chat_template: str | None = None) -> None:
        self.pad_id, self.bos_id, self.eos_id = 256, 257, 258
        self.placeholder_ids = {m: self.RESERVED[m] for m in _modalities(modalities)}
        # 256 bytes + 5 specials + reserved ids, padded to a multiple of 16 so embedding
        # tables shard evenly under tensor parallelism.
        self.vocab_size = 272
        self._special_text = {256 + i: s for i, s in enumerate(self.SPECIALS)}
        # With a chat template (data.chat_template: bytes have no template of their own) the
        # template's end of turn, the text "<eos>", is the EOS id, as in the exported tokenizer
        # (save_hf), where the specials are special tokens; without one all text is bytes.
        self.chat_template = chat_template
        self._expansions = {self.SPECIALS[2]: [self.eos_id]} if chat_template else {}

    def encode(self, text: str) -> list[int]:
        return encode_with_placeholders(text, self.placeholder_ids, lambda piece: piece.encode("utf-8"),
                                        self._expansions)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """``messages`` through the chat template, rendered as transformers renders it."""
        from dataloading.formats.chat import render_template

        if not self.chat_template:
            raise DataError("the byte tokenizer has no chat template; set data.chat_template", kind="config")
        return render_template(self.chat_template, messages, add_generation_prompt,
                               eos_token=self.SPECIALS[2], bos_token=self.SPECIALS[1])

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / OMNI_TOKENIZER_FILE).write_text(json.dumps(
            {"kind": "byte", "modalities": list(self.placeholder_ids), "chat_template": self.chat_template},
            indent=1) + "\n")

    @property
    def fingerprint(self) -> str:
        """Changes whenever the ids of some text would (token-count caches are keyed by it)."""
        return _digest(["byte", sorted(self.placeholder_ids.items()), self.chat_template])

    def save_hf(self, directory: str | Path) -> None:
        """The same tokenizer as transformers files (``tokenizer.json``...), for an exported
        model: a byte-level BPE without merges gives each byte its own token, and the byte-level
        alphabet (GPT-2's printable stand-in for each byte) is ordered so that byte b is id b;
        the specials follow at their ids. ``AutoTokenizer`` then encodes and decodes as this does."""
        import transformers
        from tokenizers import Tokenizer as Core, decoders, models, pre_tokenizers

        stand_in = byte_stand_ins()
        core = Core(models.BPE(vocab={stand_in[b]: b for b in range(256)}, merges=[]))
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        core.decoder = decoders.ByteLevel()
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=core)
        fast.add_tokens(list(self.SPECIALS), special_tokens=True)  # ids 256.. in order
        fast.pad_token, fast.bos_token, fast.eos_token = self.SPECIALS[:3]
        if self.chat_template:
            fast.chat_template = self.chat_template
        fast.save_pretrained(str(directory))

    def __repr__(self) -> str:
        return "ByteTokenizer()" if not self.chat_template else "ByteTokenizer(chat_template=...)"


def byte_stand_ins() -> dict[int, str]:
    """Byte -> the printable character byte-level BPEs write it as (GPT-2's table): printable
    Latin-1 bytes stand for themselves, the others for code points 256 and up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


class HFTokenizer:
    """Wraps ``transformers.AutoTokenizer`` loaded from a local directory. The placeholders of
    ``modalities`` (None: all) that its vocabulary lacks are appended as special tokens, except
    those ``family_tokens`` writes with the family's own tokens (which must be in the vocabulary)."""

    def __init__(self, directory: str | Path, modalities: Iterable[str] | None = None,
                 family_tokens: Mapping[str, PlaceholderTokens] | None = None, chat_template: str | None = None):
        from transformers import AutoTokenizer  # lazy: transformers is slow to import

        self.directory = Path(directory)
        # Never run Python code shipped in the directory (an `auto_map` to custom tokenizer
        # classes) and never reach the Hub: a tokenizer is data.
        try:
            tok = AutoTokenizer.from_pretrained(str(self.directory), trust_remote_code=False, local_files_only=True)
        except ValueError as e:
            if "trust_remote_code" not in str(e):
                raise
            raise DataError(f"tokenizer {self.directory}: its tokenizer_config.json names custom Python code "
                            "(auto_map), which omni never runs; use a directory saved with a standard transformers "
                            "tokenizer class (tokenizer.json)", kind="config") from None
        wanted = _modalities(modalities)
        # A video's spec (Qwen2-VL's <|video_pad|>) is kept when its encoder's (image) is wanted.
        self.family_tokens = {m: spec for m, spec in (family_tokens or {}).items() if encoder_modality(m) in wanted}
        vocab = tok.get_vocab()
        for m, spec in self.family_tokens.items():
            absent = [t for t in (spec.token, spec.before, spec.after) if t and t not in vocab]
            if absent:
                raise DataError(f"tokenizer {self.directory}: the model writes its {m} placeholder as "
                                f"{spec.before}{spec.token}{spec.after}, but {absent[0]!r} is not in the vocabulary; "
                                "use the model's own tokenizer", kind="config")
        missing = [PLACEHOLDERS[m] for m in wanted if m not in self.family_tokens and PLACEHOLDERS[m] not in vocab]
        if missing:
            # Added as special tokens so they are never split; the model's embedding table
            # must then be resized to vocab_size (the backbone loader does this).
            tok.add_tokens(missing, special_tokens=True)
        if chat_template:  # data.chat_template: for a tokenizer without one (or to replace it); saved with it
            tok.chat_template = chat_template
        self._tok = tok
        self.vocab_size = len(tok)
        self.placeholder_ids = {m: int(tok.convert_tokens_to_ids(
            self.family_tokens[m].token if m in self.family_tokens else PLACEHOLDERS[m])) for m in wanted}
        self._expansions: dict[str, list[int]] = {}
        for m, spec in self.family_tokens.items():
            # A video's token becomes its encoder's placeholder id: the id at an encoder output's
            # position is never seen by the model (the output replaces its embedding), and one id
            # per encoder keeps the data plane's rule of one placeholder per slot.
            pid = self.placeholder_ids[encoder_modality(m)]
            frame = [int(tok.convert_tokens_to_ids(t)) for t in (spec.before, spec.after)]
            self._expansions[MEDIA_PLACEHOLDERS[m]] = frame[:1] * bool(spec.before) + [pid] + frame[1:] * bool(spec.after)
            self._expansions[spec.token] = [pid]
        self.bos_id = tok.bos_token_id
        if tok.eos_token_id is None:
            raise DataError(f"tokenizer {self.directory} has no eos_token; set eos_token in its "
                            "tokenizer_config.json", kind="config")
        self.eos_id = int(tok.eos_token_id)
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        self.bytes_per_token = 4.0  # typical for English BPE; planning only

    def encode(self, text: str) -> list[int]:
        return encode_with_placeholders(
            text, self.placeholder_ids, lambda piece: self._tok.encode(piece, add_special_tokens=False),
            self._expansions)

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own chat template (None: it has none)."""
        return getattr(self._tok, "chat_template", None) or None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """``messages`` through the tokenizer's chat template (transformers' ``apply_chat_template``)."""
        if self.chat_template is None:
            raise DataError(f"tokenizer {self.directory} has no chat template", kind="config")
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        bos = self._tok.bos_token
        # The data plane puts BOS in front of every sample itself: a template that writes it
        # (Llama's) would give two.
        return text[len(bos):] if bos and self.bos_id is not None and text.startswith(bos) else text

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def fingerprint(self) -> str:
        """Changes whenever the ids of some text would (token-count caches are keyed by it): the
        tokenizer's files, the placeholders, the family tokens and the chat template."""
        files = [(f.name, hashlib_file(f)) for f in sorted(self.directory.iterdir()) if f.name in _TOKENIZER_FILES]
        return _digest(["hf", files, sorted(self.placeholder_ids.items()),
                        sorted((m, asdict(t)) for m, t in self.family_tokens.items()), self.chat_template])

    def token_id(self, token: str) -> int:
        """The id of one token of the vocabulary (a family's framing token)."""
        return int(self._tok.convert_tokens_to_ids(token))

    def save(self, directory: str | Path) -> None:
        """``save_pretrained`` (the appended placeholders included) plus which ones are used."""
        directory = Path(directory)
        self._tok.save_pretrained(str(directory))
        meta = {"kind": "hf", "modalities": list(self.placeholder_ids),
                "family_tokens": {m: asdict(spec) for m, spec in self.family_tokens.items()}}
        (directory / OMNI_TOKENIZER_FILE).write_text(json.dumps(meta, indent=1) + "\n")

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.directory)!r})"


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> None:
    """Write ``tokenizer`` into ``directory`` so that ``load_tokenizer(directory)`` gives the same ids."""
    save = getattr(tokenizer, "save", None)
    if save is None:
        raise DataError(f"tokenizer {tokenizer!r} has no save(directory) method; add one to keep the run's "
                        "tokenizer with its run", kind="config")
    save(directory)


def load_tokenizer(spec: str | Path, modalities: Iterable[str] | None = None,
                   family_tokens: Mapping[str, PlaceholderTokens] | None = None,
                   chat_template: str | None = None) -> Tokenizer:
    """``"byte"`` -> ByteTokenizer; anything else is a local directory: one written by
    ``save_tokenizer`` or a Hugging Face tokenizer. ``modalities``: whose placeholders get ids
    (None: those a saved tokenizer recorded, else all). ``family_tokens``: the model family's
    placeholder tokens (None: those a saved tokenizer recorded, else Omni's ``<image>``...).
    ``chat_template``: a Jinja chat template (``dataloading.formats.chat.resolve_chat_template``) that
    replaces the tokenizer's own (None: its own, or the one a saved byte tokenizer recorded)."""
    if str(spec) == "byte":
        return ByteTokenizer(modalities, chat_template)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise DataError(f"tokenizer {str(spec)!r}: no such directory; pass 'byte' or a local directory "
                        "holding tokenizer.json / tokenizer_config.json (downloads are not done here)",
                        kind="config")
    saved = path / OMNI_TOKENIZER_FILE
    kind = "hf"
    if saved.is_file():
        meta = json.loads(saved.read_text())
        kind = meta.get("kind", "hf")
        modalities = meta.get("modalities") if modalities is None else modalities
        if family_tokens is None:
            family_tokens = {m: PlaceholderTokens(**t) for m, t in meta.get("family_tokens", {}).items()}
        if kind == "byte" and chat_template is None:
            chat_template = meta.get("chat_template")
    if kind == "byte":
        return ByteTokenizer(modalities, chat_template)
    return HFTokenizer(path, modalities, family_tokens, chat_template)
