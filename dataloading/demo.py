"""A small, learnable, multi-source demo dataset (shards + indices + mixture.yaml).

Three sources a tiny model can learn in minutes, so an end-to-end run shows falling loss
and correct answers:

- ``shapes``: PNG of a plain/striped/checked coloured square in one quadrant of a dark image
  of varying size -> "a striped red square at the top left" (10% show two images, numbered
  fields);
- ``tones``: 16 kHz WAV of a low/mid/high, short/long tone -> "a high short tone";
- ``text``: counting, alphabet and repeated-word sequences with long-tailed lengths
  (language modelling, no response);
- ``chat``: conversations (``messages.json``) about one shape image: its colour, then its
  pattern, sometimes its place, a third with a system turn; in ``chat.yaml`` only (with the
  held-out ``eval_chat/``), for instruction tuning (experiment=llava_stage2).

``eval/`` holds held-out samples of shapes and tones drawn from the same distribution with
another random stream (every class is seen in training). Everything is a function of the
seed: two runs give byte-identical shards.
"""
from __future__ import annotations

import io
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dataloading.index.sources import cache_root

COLORS = {"red": (220, 50, 50), "green": (50, 190, 70), "blue": (60, 100, 235), "yellow": (235, 210, 50)}
PATTERNS = ("plain", "striped", "checked")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
SIDES = (32, 40, 48, 56, 64)  # multiples of 8, drawn independently: images are often non-square
IMAGE_PROMPTS = ("<image>\nDescribe the image.", "<image>\nWhat is in the picture?",
                 "Describe the image.\n<image>", "<image>\nWhat do you see?")
TWO_IMAGE_PROMPTS = ("<image>\n<image>\nDescribe both images.", "First: <image> Second: <image>\nDescribe them.")

SAMPLE_RATE = 16_000
PITCHES = {"low": 220.0, "mid": 440.0, "high": 880.0}
LENGTHS = {"short": 0.3, "long": 0.8}
AUDIO_PROMPTS = ("<audio>\nWhat do you hear?", "<audio>\nDescribe the sound.", "Listen: <audio>\nWhat is it?")

WORDS = ("cat", "dog", "sun", "tree", "blue", "red", "one", "two", "up", "down", "left", "right")
MAX_TEXT_CHARS = 900  # keeps every text sample under a 1024-token byte-level budget

SIZES = {"shapes": 2000, "tones": 1500, "text": 1500}
WEIGHTS = {"shapes": 0.6, "tones": 0.2, "text": 0.2}
EVAL_SIZES = {"shapes": 32, "tones": 32}
SHARDS_PER_SOURCE = 4
_TAGS = {"shapes": 1, "tones": 2, "text": 3, "chat": 4}
CHAT_SIZE, CHAT_EVAL_SIZE = 1500, 32


def _rng(seed: int, source: str, split: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFF_FFFF, _TAGS[source], split])


# ---- shapes -----------------------------------------------------------------------------
def _image_size(rng: np.random.Generator) -> tuple[int, int]:
    return int(rng.choice(SIDES)), int(rng.choice(SIDES))


def _shape_png(rng: np.random.Generator) -> tuple[bytes, str]:
    """A square of one colour and fill pattern in one quadrant of a dark image.

    The pattern (plain / striped / checked, 2-px period) shows in every 8-px patch the square
    covers, so a tiny encoder trained from scratch picks it up within the demo's few hundred
    steps; telling outlines apart (circle vs. triangle) takes a small ViT far longer.
    """
    from PIL import Image, ImageDraw

    color, pattern, where = (str(rng.choice(list(COLORS))), str(rng.choice(PATTERNS)), str(rng.choice(POSITIONS)))
    h, w = _image_size(rng)
    bg = rng.integers(0, 40, 3).astype(np.uint8)
    cw, ch = w / 2, h / 2
    size = min(cw, ch) * rng.uniform(0.75, 0.95)
    cx = cw / 2 + (cw if "right" in where else 0) + rng.uniform(-1, 1) * (cw - size) / 4
    cy = ch / 2 + (ch if "bottom" in where else 0) + rng.uniform(-1, 1) * (ch - size) / 4
    fill = np.clip(np.array(COLORS[color]) + rng.integers(-20, 21, 3), 0, 255).astype(np.uint8)
    r = size / 2
    outline = Image.new("L", (w, h), 0)
    ImageDraw.Draw(outline).rectangle((cx - r, cy - r, cx + r, cy + r), fill=255)
    mask = np.asarray(outline) > 0
    yy, xx = np.mgrid[0:h, 0:w]
    if pattern == "striped":
        mask &= (yy // 2) % 2 == 0
    elif pattern == "checked":
        mask &= ((yy // 2) + (xx // 2)) % 2 == 0
    pixels = np.where(mask[..., None], fill, bg).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return buf.getvalue(), f"a {pattern} {color} square at the {where}"


def _shapes(rng: np.random.Generator, n: int, key) -> Iterator[dict]:
    for i in range(n):
        if rng.random() < 0.1:
            (a, ca), (b, cb) = _shape_png(rng), _shape_png(rng)
            yield {"__key__": key(i), "txt": str(rng.choice(TWO_IMAGE_PROMPTS)), "0.png": a, "1.png": b,
                   "response.txt": f"{ca}, then {cb}"}
        else:
            png, caption = _shape_png(rng)
            yield {"__key__": key(i), "txt": str(rng.choice(IMAGE_PROMPTS)), "png": png, "response.txt": caption}


# ---- tones ------------------------------------------------------------------------------
def _tone_wav(rng: np.random.Generator) -> tuple[bytes, str]:
    import soundfile

    pitch, length = str(rng.choice(list(PITCHES))), str(rng.choice(list(LENGTHS)))
    freq = PITCHES[pitch] * (1 + rng.uniform(-0.03, 0.03))
    n = int(LENGTHS[length] * rng.uniform(0.9, 1.1) * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    wave = rng.uniform(0.3, 0.6) * np.sin(2 * np.pi * freq * t + rng.uniform(0, 2 * np.pi))
    wave += rng.uniform(0.005, 0.03) * rng.standard_normal(n)
    ramp = min(n // 2, SAMPLE_RATE // 100)  # 10 ms fades: no clicks
    env = np.ones(n)
    env[:ramp], env[n - ramp:] = np.linspace(0, 1, ramp), np.linspace(1, 0, ramp)
    buf = io.BytesIO()
    soundfile.write(buf, np.clip(wave * env, -1, 1), SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue(), f"a {pitch} {length} tone"


def _tones(rng: np.random.Generator, n: int, key) -> Iterator[dict]:
    for i in range(n):
        wav, caption = _tone_wav(rng)
        yield {"__key__": key(i), "txt": str(rng.choice(AUDIO_PROMPTS)), "wav": wav, "response.txt": caption}


# ---- text -------------------------------------------------------------------------------
def _text_line(rng: np.random.Generator) -> str:
    units = int(np.clip(round(rng.lognormal(mean=math.log(24), sigma=0.9)), 4, 400))
    kind = rng.integers(3)
    if kind == 0:  # counting with a fixed stride
        start, stride = int(rng.integers(0, 50)), int(rng.integers(1, 4))
        words = [str(start + stride * k) for k in range(units)]
    elif kind == 1:  # the alphabet, wrapping around
        first = int(rng.integers(26))
        words = [chr(ord("a") + (first + k) % 26) for k in range(units)]
    else:  # a short word pattern repeated
        pattern = [str(w) for w in rng.choice(WORDS, size=int(rng.integers(2, 5)))]
        words = [pattern[k % len(pattern)] for k in range(units)]
    text = " ".join(words)
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS].rsplit(" ", 1)[0]


def _texts(rng: np.random.Generator, n: int, key) -> Iterator[dict]:
    for i in range(n):
        yield {"__key__": key(i), "txt": _text_line(rng)}


def _chats(rng: np.random.Generator, n: int, key) -> Iterator[dict]:
    import json

    for i in range(n):
        png, caption = _shape_png(rng)
        _, pattern, color, _, _, _, where = caption.split(" ", 6)  # "a striped red square at the top left"
        turns = [{"role": "system", "content": "Answer in a few words."}] if rng.random() < 1 / 3 else []
        turns += [{"role": "user", "content": str(rng.choice(("<image>\nWhat colour is the square?",
                                                              "What colour is it?\n<image>")))},
                  {"role": "assistant", "content": f"{color}."},
                  {"role": "user", "content": "And its pattern?"},
                  {"role": "assistant", "content": f"{pattern}."}]
        if rng.random() < 0.5:
            turns += [{"role": "user", "content": "Where is it?"}, {"role": "assistant", "content": f"at the {where}."}]
        yield {"__key__": key(i), "messages.json": json.dumps(turns), "png": png}


_MAKERS = {"shapes": _shapes, "tones": _tones, "text": _texts, "chat": _chats}


# ---- writing ----------------------------------------------------------------------------
def _progress(it: Iterator[dict], total: int, desc: str, show: bool) -> Iterator[dict]:
    from tqdm import tqdm

    return iter(tqdm(it, total=total, desc=desc, unit="sample", disable=not show))


def write_demo_dataset(out_dir: str | Path, seed: int = 0, scale: float = 1.0, progress: bool = True) -> Path:
    """Write the demo dataset into ``out_dir`` and return it; the mixture is ``out_dir/mixture.yaml``
    (``vision.yaml``: the sources without audio)."""
    from dataloading.index.shards import write_shards
    from dataloading.index.source_index import build_index

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, size in SIZES.items():
        n = max(SHARDS_PER_SOURCE, int(round(size * scale)))
        per_shard = math.ceil(n / SHARDS_PER_SOURCE)
        samples = _MAKERS[name](_rng(seed, name, 0), n, lambda i: f"{i:06d}")
        write_shards(_progress(samples, n, name, progress), out / name, name, per_shard)
        build_index(out / name, workers=1, progress=False)
    for name, n in EVAL_SIZES.items():
        # Keys carry the source name: both eval sources share one indexed folder.
        samples = _MAKERS[name](_rng(seed, name, 1), n, lambda i, name=name: f"{name}-{i:06d}")
        write_shards(samples, out / "eval" / name, f"eval-{name}", n)
    build_index(out / "eval", workers=1, progress=False)
    # Conversations: their own source, held-out folder and mixture (not in the default mixture).
    n = max(SHARDS_PER_SOURCE, int(round(CHAT_SIZE * scale)))
    write_shards(_progress(_chats(_rng(seed, "chat", 0), n, lambda i: f"{i:06d}"), n, "chat", progress),
                 out / "chat", "chat", math.ceil(n / SHARDS_PER_SOURCE))
    build_index(out / "chat", workers=1, progress=False)
    write_shards(_chats(_rng(seed, "chat", 1), CHAT_EVAL_SIZE, lambda i: f"chat-{i:06d}"), out / "eval_chat" / "chat",
                 "eval-chat", CHAT_EVAL_SIZE)
    build_index(out / "eval_chat", workers=1, progress=False)
    (out / "chat.yaml").write_text("# Omni demo conversations (data.demo_mixture=chat; needs data.chat_template)\n"
                                   "sources:\n  - name: chat\n    path: chat\n    weight: 1.0\neval: eval_chat\n")
    lines = ["# Omni demo mixture (written by dataloading.demo; paths are relative to this file)", "sources:"]
    lines += [f"  - name: {name}\n    path: {name}\n    weight: {WEIGHTS[name]}" for name in SIZES]
    lines += ["eval: eval", ""]
    (out / "mixture.yaml").write_text("\n".join(lines))
    # The same without the tones, for models without an audio encoder (data.demo_mixture=vision).
    vision = [lines[0], "sources:"] + [f"  - name: {name}\n    path: {name}\n    weight: {WEIGHTS[name]}"
                                       for name in SIZES if name != "tones"] + ["eval: eval", ""]
    (out / "vision.yaml").write_text("\n".join(vision))
    return out


def default_cache_dir() -> Path:
    return cache_root() / "demo-v6"  # v6: chat.yaml


def ensure_demo_dataset(cache_dir: str | Path | None = None, *, seed: int = 0, scale: float = 1.0,
                        progress: bool = True) -> Path:
    """The demo dataset, generated on first use. Default place: ``$OMNI_CACHE/demo-v6``
    (``~/.cache/omni/demo-v6`` without OMNI_CACHE); a non-default seed or scale gets its own
    folder (``demo-v6-seed1-x0.5``). Generation goes to a temp folder that is renamed into
    place, so a crashed or concurrent run never leaves half a dataset."""
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    if seed != 0 or scale != 1.0:
        root = root.with_name(f"{root.name}-seed{seed}-x{scale:g}")
    done = root / ".complete"
    if done.exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_demo_dataset(tmp, seed=seed, scale=scale, progress=progress)
        (tmp / ".complete").write_text("ok\n")
        if root.exists() and not done.exists():
            shutil.rmtree(root)  # left over by an old, non-atomic writer
        try:
            os.rename(tmp, root)
        except OSError:
            if not done.exists():  # not another process's finished copy: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
