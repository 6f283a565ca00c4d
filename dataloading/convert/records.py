"""One input record of ``omni data convert`` -> one Omni conversation (docs/data.md, "Converting datasets").

The input formats differ in their container (a JSON list, JSONL, parquet, a ``datasets`` folder:
``dataloading.convert.inputs``) far more than in their records, which all are a list of turns plus
media lists. So every format's records are read with one lenient layout:

- turns under ``messages`` or ``conversations``; each turn's role under ``role`` or ``from``
  (``human``/``user`` -> user, ``gpt``/``assistant`` -> assistant, ``system``), its content under
  ``content`` or ``value``: a string, or a list of typed parts (``{"type": "text", "text": ...}``,
  ``{"type": "image"}``, ...) that becomes one string with the media placeholders where the parts were;
- media under ``images``/``image``, ``videos``/``video``, ``audios``/``audio`` (one item or a list;
  an item is a path, bytes, a ``{"bytes", "path"}`` struct as Hugging Face stores an ``Image``, or a
  data URL), or inline in a content part (``{"type": "image", "image": "a.jpg"}``);
- a ``system`` string as the first turn (ShareGPT), the ``id``, and other scalar fields kept as metadata.

Only ``--from llava`` adds the placeholders a record lacks (LLaVA puts its image before the first
user turn's text); elsewhere a count that differs from the media is the record's problem, found
by the training reader's own checks (``dataloading.convert.run`` applies them).
"""
from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field
from typing import Any

from dataloading.formats.chat import prompt_text
from dataloading.formats.media import MEDIA_PLACEHOLDERS
from dataloading.formats.modality import MODALITIES
from dataloading.formats.sample import placeholder_modalities

#: ``--from`` values: the input container of each is read by ``dataloading.convert.inputs``.
FORMATS = ("llava", "sharegpt", "jsonl", "parquet", "hf-dataset")
#: Formats whose records may leave out the placeholders of their media (LLaVA's convention).
PLACES_MISSING_PLACEHOLDERS = ("llava",)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_TURN_KEYS = ("messages", "conversations")
_ROLE_KEYS = ("role", "from")
_CONTENT_KEYS = ("content", "value")
# The record keys that list each kind's items, and the content part types that stand for an item
# (OpenAI's and transformers' chat formats): their declarations' ``record_keys``, ``part_types``.
_MEDIA_KEYS = {m.name: m.record_keys for m in MODALITIES if m.record_keys}
_PART_KINDS = {part: m.name for m in MODALITIES for part in m.part_types}
_KNOWN_KEYS = {"id", "system", *_TURN_KEYS, *(k for keys in _MEDIA_KEYS.values() for k in keys)}


class RecordProblem(Exception):
    """Why one record cannot be converted; listed in ``convert_report.jsonl`` as ``"kind: detail"``.

    Kinds: ``bad_record``, ``no_assistant_turn``, ``placeholder_mismatch``, ``missing_media``,
    ``unsupported_media``, ``unreadable_media`` (docs/data.md, "Converting datasets")."""

    def __init__(self, kind: str, detail: str):
        super().__init__(kind, " ".join(str(detail).split()))  # one line in the report
        self.kind, self.detail = kind, " ".join(str(detail).split())

    @property
    def reason(self) -> str:
        return f"{self.kind}: {self.detail}"


@dataclass
class MediaRef:
    """A media item as the record gives it: a path (resolved under --media-root later), its bytes,
    or both (a Hugging Face struct: the path then only tells the file type)."""

    kind: str  # image, video or audio
    path: str | None = None
    data: bytes | None = None
    ext: str | None = None  # the type a data URL names, when there is no path


@dataclass
class Conversation:
    id: Any
    messages: list[dict[str, str]]  # [{"role", "content"}], placeholders inside the content
    media: list[MediaRef]  # in placeholder order across the whole conversation
    meta: dict[str, Any] = field(default_factory=dict)


def _first_key(d: dict, keys: tuple[str, ...], where: str) -> Any:
    present = [k for k in keys if d.get(k) is not None]
    if len(present) > 1:
        raise RecordProblem("bad_record", f"{where} has both {present[0]!r} and {present[1]!r}; keep one")
    return d[present[0]] if present else None


def _pil_png(image: Any) -> bytes:
    # A decoded PIL image has lost its file's bytes; PNG keeps its pixels exactly.
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(kind: str, url: str, where: str) -> MediaRef:
    head, _, payload = url.partition(",")
    if not head.endswith(";base64"):
        raise RecordProblem("bad_record", f"{where}: a data URL that is not base64; give the file's path instead")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RecordProblem("bad_record", f"{where}: its data URL is not valid base64") from None
    subtype = head[len("data:"):-len(";base64")].partition("/")[2]  # image/png -> png
    return MediaRef(kind, data=data, ext=subtype.lower() or None)


def media_ref(kind: str, value: Any, where: str) -> MediaRef:
    """One media item of any accepted form (see the module's docstring)."""
    if isinstance(value, dict):
        if "url" in value and not ({"bytes", "path"} & value.keys()):  # {"url": ...} of an image_url part
            return media_ref(kind, value["url"], where)
        if "data" in value and "format" in value:  # OpenAI's input_audio: base64 data and its format
            return _data_url(kind, f"data:audio/{value['format']};base64,{value['data']}", where)
        data, path = value.get("bytes"), value.get("path")
        if data is None and path is None:
            raise RecordProblem("bad_record", f"{where} has neither bytes nor a path")
        ref = media_ref(kind, path, where) if path is not None else MediaRef(kind)
        if data is not None:
            ref.data = bytes(data)
        return ref
    if isinstance(value, (bytes, bytearray, memoryview)):
        return MediaRef(kind, data=bytes(value))
    if isinstance(value, str):
        if value.startswith("data:"):
            return _data_url(kind, value, where)
        if "://" in value:
            raise RecordProblem("bad_record", f"{where} is a URL ({value}); download the media and give its path")
        if not value.strip():
            raise RecordProblem("bad_record", f"{where} is an empty path")
        return MediaRef(kind, path=value)
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image (a decoded datasets Image)
        return MediaRef(kind, data=_pil_png(value), ext="png")
    raise RecordProblem("bad_record", f"{where} is a {type(value).__name__}; give a path, bytes or "
                                      f"{{'bytes', 'path'}}")


def _part_text(part: Any, inline: dict[str, list[MediaRef]], where: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise RecordProblem("bad_record", f"{where} is not a typed part ({{'type': 'text', 'text': ...}})")
    kind = _PART_KINDS.get(part["type"])
    if part["type"] == "text":
        if not isinstance(part.get("text"), str):
            raise RecordProblem("bad_record", f"{where} is a text part without a 'text' string")
        return part["text"]
    if kind is None:
        raise RecordProblem("bad_record", f"{where} has type {part['type']!r}; use text, "
                                          f"{', '.join(sorted(_PART_KINDS))}")
    # Parts read from parquet carry every key of the column's struct, the unused ones None.
    value = next((part[k] for k in (part["type"], kind, "path", "url") if part.get(k) is not None), None)
    if value is not None:
        inline.setdefault(kind, []).append(media_ref(kind, value, where))
    return MEDIA_PLACEHOLDERS[kind]


def _content(value: Any, inline: dict[str, list[MediaRef]], where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_part_text(p, inline, f"{where}, part {i}") for i, p in enumerate(value))
    raise RecordProblem("bad_record", f"{where}: content is {type(value).__name__}; give a string or a list of "
                                      "typed parts")


def _messages(record: dict, inline: dict[str, list[MediaRef]]) -> list[dict[str, str]]:
    turns = _first_key(record, _TURN_KEYS, "the record")
    if turns is None:
        raise RecordProblem("bad_record", f"no turns: the record has no {' or '.join(_TURN_KEYS)} list")
    if not isinstance(turns, list) or not turns:
        raise RecordProblem("bad_record", f"the turns are {type(turns).__name__ if turns else 'empty'}; give a "
                                          "list of {role, content} turns")
    messages = []
    system = record.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise RecordProblem("bad_record", f"'system' is {type(system).__name__}; give a string")
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        where = f"turn {i}"
        if not isinstance(turn, dict):
            raise RecordProblem("bad_record", f"{where} is {type(turn).__name__}; give {{role, content}}")
        role = _first_key(turn, _ROLE_KEYS, where)
        if role not in ROLES:
            raise RecordProblem("bad_record", f"{where} has role {role!r}; use one of {', '.join(ROLES)}")
        content = _first_key(turn, _CONTENT_KEYS, where)
        if content is None:
            raise RecordProblem("bad_record", f"{where} has no {' or '.join(_CONTENT_KEYS)}")
        messages.append({"role": ROLES[role], "content": _content(content, inline, where)})
    return messages


def _listed_media(record: dict) -> dict[str, list[MediaRef]]:
    out = {}
    for kind, keys in _MEDIA_KEYS.items():
        key = next((k for k in keys if record.get(k) is not None), None)
        value = _first_key(record, keys, "the record")
        if value is None:
            continue
        items = value if isinstance(value, list) else [value]
        out[kind] = [media_ref(kind, v, f"{key}[{i}]" if isinstance(value, list) else key)
                     for i, v in enumerate(items)]
    return out


def _kinds(messages: list[dict[str, str]]) -> list[str]:
    return placeholder_modalities(prompt_text(messages))  # as the reader finds them


def _place_missing(messages: list[dict[str, str]], media: dict[str, list[MediaRef]]) -> None:
    """LLaVA's convention: the media of a record without their placeholders go before the text of
    the first user turn, one placeholder per line."""
    have = _kinds(messages)
    missing = "".join(f"{MEDIA_PLACEHOLDERS[k]}\n" * len(refs) for k, refs in media.items() if refs and k not in have)
    if missing:
        first = next((m for m in messages if m["role"] == "user"), None)
        if first is not None:
            first["content"] = missing + first["content"]


def _scalar_meta(record: dict) -> dict[str, Any]:
    return {k: v for k, v in record.items()
            if k not in _KNOWN_KEYS and isinstance(v, (str, int, float, bool)) and not k.startswith("__")}


def to_conversation(record: Any, fmt: str, default_id: str) -> Conversation:
    """``record`` (one decoded input record) as a Conversation, or a RecordProblem."""
    if isinstance(record, RecordProblem):  # the container could not even decode it
        raise record
    if not isinstance(record, dict):
        raise RecordProblem("bad_record", f"the record is a {type(record).__name__}, not an object")
    inline: dict[str, list[MediaRef]] = {}
    messages = _messages(record, inline)
    listed = _listed_media(record)
    for kind in sorted(set(inline) & set(listed)):
        raise RecordProblem("bad_record", f"{kind} media both listed ({'/'.join(_MEDIA_KEYS[kind])}) and inline in "
                                          "content parts; give them one way")
    media = {**listed, **inline}
    if fmt in PLACES_MISSING_PLACEHOLDERS:
        _place_missing(messages, media)
    # Media in placeholder order. Whether the placeholders and the media agree (in number and
    # kind), and whether the turns make a conversation to learn from, is the training reader's
    # rule (dataloading.formats.sample.parse_fields), which the converter applies to the sample it writes;
    # items without a placeholder go last, so that the reader names the mismatch.
    queues = {k: list(v) for k, v in media.items()}
    ordered = [queues[k].pop(0) for k in _kinds(messages) if queues.get(k)]
    ordered += [ref for k in MEDIA_PLACEHOLDERS for ref in queues.get(k, [])]
    return Conversation(record_id(record, default_id), messages, ordered, _scalar_meta(record))


def record_id(record: Any, default_id: str) -> Any:
    """The record's own ``id`` (also for the report line of a record that cannot be converted), else
    ``default_id`` (``<input file stem>-<position>``)."""
    rid = record.get("id") if isinstance(record, dict) else None
    return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else default_id
