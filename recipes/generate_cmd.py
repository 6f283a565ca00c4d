"""``omni generate``: one prompt with its media through a model (a Hugging Face directory, a run
directory or a checkpoint folder), KV-cached (``omni.runtime.generate``, the engine the
end-of-run evaluation uses too).

The prompt is one user turn holding the media and then the text, rendered by the tokenizer's
chat template with the generation prompt added; a tokenizer without one (Omni's byte tokenizer)
gets the media placeholders, each on its own line, then the text, as Omni's sample format
writes them. Every argument is checked before the model is read."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Sequence

from omni.errors import ConfigError


def _sampling(greedy: bool, temperature: Optional[float], top_p: Optional[float], top_k: Optional[int], seed: int):
    from omni.runtime.generate import Sampling

    drawn = temperature is not None or top_p is not None or top_k is not None
    if greedy and drawn:
        raise ConfigError("--greedy picks the most likely token; drop it to sample with --temperature/--top-p/--top-k")
    try:
        if not drawn:
            return Sampling(greedy=True)
        return Sampling(greedy=False, temperature=1.0 if temperature is None else temperature,
                        top_p=1.0 if top_p is None else top_p, top_k=top_k or 0, seed=seed)
    except ValueError as e:
        raise ConfigError(f"--{str(e).replace('_', '-')}") from None


def _media_files(images: Sequence[str], videos: Sequence[str], audios: Sequence[str]) -> list[tuple[str, Path]]:
    files = [("image", Path(p)) for p in images] + [("video", Path(p)) for p in videos] + \
            [("audio", Path(p)) for p in audios]
    for kind, path in files:
        if not path.is_file():
            raise ConfigError(f"--{kind} {path}: no such file")
    return files


def _with_audio_track(video, path: Path):
    """``video`` (a decoded ``Video``) with its own audio track; one line when it has none."""
    import dataclasses

    from dataloading.formats.video import audio_track

    track = audio_track(video.data)
    if track is None:
        raise ConfigError(f"--video-audio: {path} has no audio track; drop --video-audio for its frames alone")
    return dataclasses.replace(video, audio=track)


def _decode(kind: str, path: Path):
    """The file of ``--{kind}`` decoded; one that is not such a file (an image given as
    ``--audio``, a damaged video) is one line naming it, in its declaration's words
    (``Modality.description``), and the option its extension suggests."""
    from dataloading.errors import DataError
    from dataloading.formats.modality import MODALITIES

    declared = MODALITIES[kind]
    try:
        return declared.decode(path.read_bytes())  # a video's frames are decoded when the processor samples them
    except DataError:
        raise  # the video decoder is not installed: its own line says how to install it
    except Exception as e:  # each decoder's library raises its own kinds (PIL, libsndfile, FFmpeg)
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
        cause = re.sub(r"<_io\.BytesIO object at 0x[0-9a-f]+>", "the file", cause)  # libsndfile names its buffer
        other = MODALITIES.of_extension(path.suffix.lower().lstrip("."))
        hint = (f"; it looks like {MODALITIES[other].description}: pass it with --{other}" if other not in (None, kind)
                else f"; check that it is {declared.description} and not damaged")
        raise ConfigError(f"--{kind} {path}: cannot be read as {declared.description} ({type(e).__name__}: "
                          f"{cause[:200]}){hint}") from None


def prompt_text(tokenizer, kinds: list[str], prompt: str) -> str:
    """One user turn: the media of ``kinds`` (image, video, audio), then ``prompt``."""
    from dataloading.formats.media import MEDIA_PLACEHOLDERS

    if getattr(tokenizer, "chat_template", None):
        content = [{"type": k} for k in kinds] + [{"type": "text", "text": prompt}]
        return tokenizer.render_chat([{"role": "user", "content": content}], add_generation_prompt=True)
    return "".join(MEDIA_PLACEHOLDERS[k] + "\n" for k in kinds) + prompt


def eos_ids(loaded) -> set[int]:
    """The tokenizer's end of sequence, and those the model's generation config adds (chat
    models stop at the end of their turn as well)."""
    eos = {int(loaded.tokenizer.eos_id)}
    config = Path(loaded.weights) / "generation_config.json"
    if config.is_file():
        extra = json.loads(config.read_text()).get("eos_token_id")
        eos.update(int(e) for e in (extra if isinstance(extra, list) else [extra] if extra is not None else []))
    return eos


def generate_main(model: str, prompt: str, images: Sequence[str] = (), videos: Sequence[str] = (),
                  audios: Sequence[str] = (), max_new_tokens: int = 128, greedy: bool = False,
                  temperature: Optional[float] = None, top_p: Optional[float] = None, top_k: Optional[int] = None,
                  seed: int = 0, as_json: bool = False, step: Optional[int] = None, device: str = "cpu",
                  video_audio: bool = False) -> int:
    """``video_audio``: each video's own audio track goes to the audio tower beside its frames
    (interleaved, as the Qwen2.5-Omni and Qwen3-Omni thinkers take them)."""
    import torch

    from dataloading.construct.constructor import SampleConstructor
    from dataloading.formats.media import as_encoder_placeholders, encoder_modality, processor_for
    from dataloading.formats.modality import AUDIO, VIDEO
    from dataloading.formats.sample import DecodedSample
    from omni.models.build import media_processors
    from omni.runtime.generate import generate
    from recipes.model_source import load_model, locate

    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    sampling = _sampling(greedy, temperature, top_p, top_k, seed)
    files = _media_files(images, videos, audios)
    media = [(kind, _decode(kind, path)) for kind, path in files]  # a video: its header only
    if video_audio:
        media = [(kind, _with_audio_track(raw, path) if kind == VIDEO.name else raw) for (kind, raw), (_, path)
                 in zip(media, files)]
    where = locate(model, step)
    loaded = load_model(where)
    processors = media_processors(loaded.model)
    for kind, path in files:
        if encoder_modality(kind) not in processors:
            have = ", ".join(sorted(processors)) or "none"
            raise ConfigError(f"--{kind} {path}: the model has no {encoder_modality(kind)} encoder (it has: {have})")
        processor_for(processors, kind, f"--{kind} {path}")  # one that cannot take a video says so
    if video_audio and videos and AUDIO.name not in processors:
        raise ConfigError(f"--video-audio: the model has no audio encoder for the videos' tracks (it has: "
                          f"{', '.join(sorted(processors))})")
    tokenizer = loaded.tokenizer
    text = prompt_text(tokenizer, [k for k, _ in files], prompt)
    ids = tokenizer.encode(as_encoder_placeholders(text))
    for modality in {encoder_modality(k) for k, _ in files}:
        written = ids.count(tokenizer.placeholder_ids[modality])
        given = sum(encoder_modality(k) == modality for k, _ in files)
        if written != given:
            raise ConfigError(f"the prompt holds {written} {modality} placeholder(s) for {given} media file(s) encoded "
                              f"as {modality}; the model's chat template must place each media item")
    constructor = SampleConstructor({}, tokenizer, processors, None)
    batch, _ = constructor.build_prompt(DecodedSample("prompt", text, None, media))
    dev = torch.device(device)
    loaded.model.to(dev)
    out = generate(loaded.model, [batch], eos_ids(loaded), max_new_tokens, dev, sampling)[0]
    answer = tokenizer.decode(out)
    if as_json:
        print(json.dumps({"text": answer, "token_ids": out}), flush=True)
    else:
        print(answer, flush=True)
    return 0
