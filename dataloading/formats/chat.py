"""Conversations: a sample's ``messages.json`` turns, rendered by the tokenizer's chat template,
with the assistant turns marked as the text that gets a loss.

A conversation is a list of turns ``{"role": "system"|"user"|"assistant", "content": ...}``;
the content is a string holding media placeholders (``<image>``, ``<video>``, ``<audio>``) where
the media go, or a list of typed parts (``{"type": "text", "text": ...}``, ``{"type": "image"}``,
...) that is read as that string. The whole conversation is rendered once by the tokenizer's
own template (``apply_chat_template``), never by a template restated here.

Which characters of the rendering are an assistant turn is found by rendering prefixes: turn
``i``'s text starts where the rendering of turns ``0..i-1`` *with the generation prompt* ends
(what the model sees before it answers) and ends where the rendering of turns ``0..i`` ends,
less trailing whitespace: the answer plus the template's end-of-turn marker (``<|im_end|>``,
``<|eot_id|>``), which is what a model must learn to emit to stop, and not the newline a
template writes between turns. This is the span that the ``{% generation %}`` blocks of a
template that has them mark (transformers' ``return_assistant_tokens_mask``;
tests/data/test_data_chat.py checks the two agree), and it needs no such blocks. A template
whose renderings are not prefixes of each other (one that rewrites earlier turns, e.g. drops
their reasoning) cannot be split this way and is refused with the sample named.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from dataloading.errors import DataError
from dataloading.formats.media import MEDIA_PLACEHOLDERS

ROLES = ("system", "user", "assistant")
# Which assistant turns get a loss (the per-source option ``assistant_loss``).
ASSISTANT_LOSS = ("all", "last")
MESSAGES_FIELD = "messages.json"
_HINT = "see docs/data.md (conversations)"

# Chat templates for tokenizers that have none (the byte tokenizer, a base model's), by name
# (``data.chat_template=plain``). ``plain`` marks turns with text only, so any tokenizer reads
# it; the end of an assistant turn is the tokenizer's EOS, which the model learns to emit.
BUILTIN_CHAT_TEMPLATES = {
    "plain": (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' }}"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}{{ '<' + part['type'] + '>' }}{% endif %}"
        "{% endfor %}{% endif %}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"),
}


def resolve_chat_template(value: str | None) -> str | None:
    """``data.chat_template``: None (the tokenizer's own), a built-in name, a ``.jinja`` file, or
    the template itself (text holding ``{%`` or ``{{``)."""
    if value is None or "{%" in value or "{{" in value:
        return value
    if value in BUILTIN_CHAT_TEMPLATES:
        return BUILTIN_CHAT_TEMPLATES[value]
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    raise DataError(f"data.chat_template={value!r} is neither a built-in template ({sorted(BUILTIN_CHAT_TEMPLATES)}), "
                    "a file, nor a Jinja template; pass one of those (or leave it unset to use the tokenizer's own)",
                    kind="config")


def render_template(template: str, messages: list[dict], add_generation_prompt: bool, **specials: str) -> str:
    """A Jinja chat template rendered exactly as transformers renders it (its own function), so
    a tokenizer exported with the template renders the same text."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                        add_generation_prompt=add_generation_prompt, **specials)
    return rendered[0]


def _content_text(sample_id: str, i: int, content: Any) -> str:
    """A turn's content as one string; typed parts become their text or their placeholder."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            elif kind in MEDIA_PLACEHOLDERS:
                out.append(MEDIA_PLACEHOLDERS[kind])
            else:
                raise DataError(f"sample {sample_id}: turn {i} has a content part {part!r}; parts are "
                                f"{{'type': 'text', 'text': ...}} or {{'type': one of {sorted(MEDIA_PLACEHOLDERS)}}}, "
                                f"{_HINT}", kind="bad_messages")
        return "".join(out)
    raise DataError(f"sample {sample_id}: turn {i}'s content is a {type(content).__name__}; write a string or a "
                    f"list of typed parts, {_HINT}", kind="bad_messages")


def parse_messages(sample_id: str, data: bytes) -> list[dict[str, str]]:
    """The turns of a ``messages.json`` field, checked, each content a string."""
    try:
        turns = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise DataError(f"sample {sample_id}: field {MESSAGES_FIELD!r} is not UTF-8 JSON ({e}); {_HINT}",
                        kind="bad_messages") from None
    if not isinstance(turns, list) or not turns:
        raise DataError(f"sample {sample_id}: {MESSAGES_FIELD} must be a non-empty list of turns, {_HINT}",
                        kind="bad_messages")
    out = []
    for i, turn in enumerate(turns):
        role = turn.get("role") if isinstance(turn, dict) else None
        if role not in ROLES or "content" not in turn:
            raise DataError(f"sample {sample_id}: turn {i} is {str(turn)[:80]!r}; each turn needs a 'role' (one of "
                            f"{list(ROLES)}) and a 'content', {_HINT}", kind="bad_messages")
        text = _content_text(sample_id, i, turn["content"])
        if role == "assistant" and any(p in text for p in MEDIA_PLACEHOLDERS.values()):
            raise DataError(f"sample {sample_id}: assistant turn {i} holds a media placeholder; media go in user or "
                            "system turns", kind="placeholder_mismatch")
        out.append({"role": role, "content": text})
    if not any(t["role"] == "assistant" for t in out):
        raise DataError(f"sample {sample_id}: the conversation has no assistant turn, so nothing to learn",
                        kind="no_assistant_turn")
    return out


def prompt_text(messages: Sequence[dict[str, str]]) -> str:
    """Every turn's content in order: where the media placeholders are, for matching media fields."""
    return "".join(t["content"] for t in messages)


def last_answer(messages: Sequence[dict[str, str]]) -> tuple[list[dict[str, str]], str]:
    """(the turns before the last assistant turn, that turn's content): a held-out question."""
    last = max(i for i, t in enumerate(messages) if t["role"] == "assistant")
    return list(messages[:last]), messages[last]["content"]


def render_segments(tokenizer, sample_id: str, messages: Sequence[dict[str, str]],
                    assistant_loss: str = "all") -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive (text, gets a loss) pieces.

    ``assistant_loss``: ``all`` assistant turns get a loss, or only the ``last``."""
    render = getattr(tokenizer, "render_chat", None)
    if render is None or not getattr(tokenizer, "chat_template", None):
        raise DataError(f"sample {sample_id} is a conversation but tokenizer {tokenizer!r} has no chat template; "
                        "use the chat model's own tokenizer, or set data.chat_template (e.g. data.chat_template=plain "
                        "for data.tokenizer=byte)", kind="config")

    def render_turns(turns: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return render(list(turns), add_generation_prompt=add_generation_prompt)
        except DataError:
            raise
        except Exception as e:  # the template's own checks (jinja raise_exception: roles must alternate, ...)
            raise DataError(f"sample {sample_id}: the chat template refused the conversation ({type(e).__name__}: "
                            f"{e})", kind="chat_template") from None

    full = render_turns(messages, False)
    answers = [i for i, t in enumerate(messages) if t["role"] == "assistant"]
    if assistant_loss == "last":
        answers = answers[-1:]
    pieces: list[tuple[str, bool]] = []
    done = 0
    for i in answers:
        before = render_turns(messages[:i], True)
        through = render_turns(messages[:i + 1], False)
        start, end = len(before), len(through.rstrip())
        if not (full.startswith(through) and through.startswith(before)) or start < done or end <= start:
            raise DataError(f"sample {sample_id}: the chat template does not render assistant turn {i} as an "
                            "extension of the turns before it and their generation prompt (it rewrites earlier "
                            "turns), so the assistant text cannot be located; use a template that renders turns "
                            "in order", kind="chat_template")
        pieces += [(full[done:start], False), (full[start:end], True)]
        done = end
    pieces.append((full[done:], False))
    return [(text, target) for text, target in pieces if text]
