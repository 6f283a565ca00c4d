"""Tiny Qwen2.5-Omni thinker directories (the vision and the audio tower into a Qwen2 with
M-RoPE), saved by transformers itself, in the thinker-only layout or the released one, and
transformers' inputs for them."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from hf_family_helpers import byte_level_tokenizer

OMNI_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>",
                 "<|VIDEO|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]
# ChatML as Qwen2.5-Omni's template writes media: each item framed by its modality's tokens.
OMNI_CHAT = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif part['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif part['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MEL_BINS = 128  # the released feature extractor's (WhisperFeatureExtractor feature_size)


def save_tiny_qwen2_5_omni(path: Path, seed: int = 0, std: float = 0.15, released: bool = False):
    """A tiny Qwen2.5-Omni thinker: Qwen2.5-VL's tower (2 layers, windows in the first), an audio
    tower of 2 layers over 8-frame chunks, a Qwen2 of 3 layers with M-RoPE; its tokenizer, image
    processor and feature extractor in ``path``. ``released``: the tensors under ``thinker.``
    and the config nested as a whole Qwen2.5-Omni's (``thinker_config``, no talker), as the
    released checkpoints hold them; else what transformers saves for the thinker alone.
    Returns (the transformers thinker, the tokenizer)."""
    import transformers

    tok, ids = _chat_tokenizer(OMNI_SPECIALS, OMNI_CHAT, seed)
    cfg = transformers.Qwen2_5OmniThinkerConfig(
        text_config=dict(hidden_size=40, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=272, eos_token_id=ids["<|im_end|>"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 2, 2]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
                           out_hidden_size=40, fullatt_block_indexes=[1], window_size=56),
        audio_config=dict(num_mel_bins=MEL_BINS, d_model=32, encoder_layers=2, encoder_attention_heads=4,
                          encoder_ffn_dim=48, n_window=4, output_dim=40, max_source_positions=64),
        audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"], video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"])
    model = transformers.Qwen2_5OmniThinkerForConditionalGeneration(cfg)
    return _drawn_saved(model, tok, Path(path), std, 14, "Qwen2_5OmniProcessor",
                        ("qwen2_5_omni", "Qwen2_5OmniForConditionalGeneration") if released else None)


QWEN3_OMNI_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]
# ChatML as Qwen3-Omni's template writes media (the Qwen3 vocabulary's tokens)
QWEN3_OMNI_CHAT = OMNI_CHAT.replace("<|vision_bos|>", "<|vision_start|>").replace("<|vision_eos|>", "<|vision_end|>") \
    .replace("<|IMAGE|>", "<|image_pad|>").replace("<|VIDEO|>", "<|video_pad|>").replace("<|audio_bos|>", "<|audio_start|>") \
    .replace("<|audio_eos|>", "<|audio_end|>").replace("<|AUDIO|>", "<|audio_pad|>")


def save_tiny_qwen3_omni(path: Path, seed: int = 0, std: float = 0.15, released: bool = False):
    """A tiny Qwen3-Omni thinker: Qwen3-VL's tower (3 layers, 16-pixel patches, a 3 x 3 position
    table, DeepStack from two layers), Qwen3-Omni's audio tower (2 layers), a Qwen3-MoE of 3
    layers (5 experts of 24, top 2, the middle layer dense) with interleaved M-RoPE (the audio
    tower's chunks of 100 frames, attention over 2 of them: transformers' tower counts 13 tokens a
    chunk, which holds only for n_window 49 to 52); its tokenizer,
    image processor and feature extractor in ``path``. ``released``: as ``save_tiny_qwen2_5_omni``.
    Returns (the transformers thinker, the tokenizer)."""
    import transformers

    tok, ids = _chat_tokenizer(QWEN3_OMNI_SPECIALS, QWEN3_OMNI_CHAT, seed)
    cfg = transformers.Qwen3OmniMoeThinkerConfig(
        text_config=dict(hidden_size=40, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=12, vocab_size=272, num_experts=5, num_experts_per_tok=2,
                         moe_intermediate_size=24, mlp_only_layers=[1], eos_token_id=ids["<|im_end|>"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2],
                                          "interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16, out_hidden_size=40,
                           num_position_embeddings=9, deepstack_visual_indexes=[0, 2]),
        audio_config=dict(num_mel_bins=MEL_BINS, d_model=32, encoder_layers=2, encoder_attention_heads=4,
                          encoder_ffn_dim=48, output_dim=40, downsample_hidden_size=8, n_window=50, n_window_infer=200,
                          max_source_positions=64),
        audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        audio_start_token_id=ids["<|audio_start|>"], vision_start_token_id=ids["<|vision_start|>"],
        position_id_per_seconds=13)
    model = transformers.Qwen3OmniMoeThinkerForConditionalGeneration(cfg)
    return _drawn_saved(model, tok, Path(path), std, 16, "Qwen3OmniMoeProcessor",
                        ("qwen3_omni_moe", "Qwen3OmniMoeForConditionalGeneration") if released else None)


def _chat_tokenizer(specials: list[str], template: str, seed: int):
    """A byte-level tokenizer with ``specials`` and the chat ``template`` (ending turns with
    <|im_end|>), its special tokens' ids; torch's generator seeded for the weights drawn next."""
    tok = byte_level_tokenizer(specials, eos="<|im_end|>", chat_template=template)
    torch.manual_seed(seed)
    return tok, {t: tok.convert_tokens_to_ids(t) for t in specials}


def drawn_large(model, std: float = 0.15):
    """``model`` in eval mode with weights drawn large (norm gains about 1, the rest N(0, std)):
    attention far from uniform, so positions and layout matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name or "ln_" in name else p.normal_(0.0, std)
    return model.eval()


def _drawn_saved(model, tok, path: Path, std: float, patch: int, processor: str, released):
    """``model`` with weights drawn large (norm gains about 1, the rest N(0, std)), saved with
    ``tok`` and the processor's files (the image processor of ``patch``-pixel patches, the 128-bin
    feature extractor) to ``path``; ``released``: (model type, class) of the whole model, whose
    layout the files then take. Returns (the model in eval mode, the tokenizer)."""
    import transformers

    model = drawn_large(model, std)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    side = 2 * patch
    image = transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": side * side, "longest_edge": side * side * 16},
                                                  patch_size=patch, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    audio = transformers.WhisperFeatureExtractor(feature_size=MEL_BINS)
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": processor, "image_processor": image.to_dict(), "feature_extractor": audio.to_dict()}, indent=2))
    if released:
        _as_released(path, *released)
    return model, tok


def _as_released(path: Path, model_type: str, architecture: str) -> None:
    """The thinker's files as a whole Omni checkpoint (``model_type``, ``architecture``) holds
    them: every tensor under ``thinker.``, the config nested as ``thinker_config`` (audio output
    off: no talker)."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    save_file({f"thinker.{k}": v for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    thinker = json.loads((path / "config.json").read_text())
    thinker.pop("architectures", None)
    (path / "config.json").write_text(json.dumps({
        "architectures": [architecture], "model_type": model_type, "enable_audio_output": False,
        "thinker_config": thinker}, indent=2))


def tone(seconds: float, hz: float = 440.0, rate: int = 16000) -> np.ndarray:
    """A sine tone (float32 samples at ``rate``)."""
    t = np.arange(int(seconds * rate), dtype=np.float32) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def omni_hf_inputs(directory: Path, images, waves, ids: np.ndarray) -> dict:
    """transformers' thinker inputs for ``ids`` (placeholders already expanded), PIL ``images``
    and 16 kHz ``waves``, prepared as Qwen2.5-Omni's processor prepares them (the image
    processor as saved; the feature extractor padding to 30 s with its frame mask)."""
    import transformers

    settings = json.loads((Path(directory) / "processor_config.json").read_text())
    # the attention mask too: without it the thinker cannot build its 3-D positions and falls
    # back to 1-D ones (compute_3d_position_ids)
    out = dict(input_ids=torch.as_tensor(ids)[None], attention_mask=torch.ones(1, len(ids), dtype=torch.int64))
    if images:
        image = transformers.Qwen2VLImageProcessorPil(**{k: v for k, v in settings["image_processor"].items()
                                                         if k not in ("image_processor_type", "processor_class")})
        out.update(image(images=list(images), return_tensors="pt"))
    if waves:
        extractor = settings.get("feature_extractor") or {"feature_size": MEL_BINS}
        audio = transformers.WhisperFeatureExtractor(**{k: v for k, v in extractor.items()
                                                        if k not in ("feature_extractor_type", "processor_class")})
        if settings["processor_class"] == "Qwen2_5OmniProcessor":  # every clip zero-padded to 30 s
            feats = audio(list(waves), sampling_rate=16000, padding="max_length", return_attention_mask=True,
                          return_tensors="pt")
            out.update(input_features=feats["input_features"], feature_attention_mask=feats["attention_mask"])
        else:  # Qwen3-Omni's pads to the batch's longest clip: each clip as its processor takes it alone
            clips = [audio(w, sampling_rate=16000, padding=True, return_attention_mask=True,
                           return_tensors="pt")["input_features"][0] for w in waves]
            longest = max(c.shape[1] for c in clips)
            feats = torch.zeros(len(clips), clips[0].shape[0], longest)
            mask = torch.zeros(len(clips), longest, dtype=torch.int64)
            for i, c in enumerate(clips):
                feats[i, :, :c.shape[1]], mask[i, :c.shape[1]] = c, 1
            out.update(input_features=feats, feature_attention_mask=mask)
    return out


def omni_prompt(loaded, image, waves, prompt: str = "what do you see and hear?"):
    """An image, audio clips and a question in one user turn, built as ``omni generate`` builds
    it: Omni's micro-batch."""
    media = [("image", image)] * (image is not None) + [("audio", (w, 16000)) for w in waves]
    return omni_prompt_media(loaded, media, prompt)


def omni_prompt_media(loaded, media, prompt: str):
    """``media`` ((kind, decoded), in order) and a question in one user turn, built as ``omni
    generate`` builds it: Omni's micro-batch."""
    from dataloading.construct.constructor import SampleConstructor
    from dataloading.formats.sample import DecodedSample
    from omni.models.build import media_processors
    from recipes.generate_cmd import prompt_text

    text = prompt_text(loaded.tokenizer, [kind for kind, _ in media], prompt)
    c = SampleConstructor({}, loaded.tokenizer, media_processors(loaded.model), None)
    mb, _ = c.build_prompt(DecodedSample("prompt", text, None, list(media)))
    return mb


# family -> (saver, the thinker-only model type, the whole model's, the image and audio placeholders)
THINKERS = {"qwen2_5_omni": (save_tiny_qwen2_5_omni, "qwen2_5_omni_thinker", "qwen2_5_omni", "<|IMAGE|>", "<|AUDIO|>"),
            "qwen3_omni": (save_tiny_qwen3_omni, "qwen3_omni_moe_thinker", "qwen3_omni_moe", "<|image_pad|>",
                           "<|audio_pad|>")}


def check_audio_config_round_trip(cls, path, d_model: int, out_dim: int, whole_type: str) -> None:
    """An Omni audio tower plugin ``cls`` reads the thinker's preprocessing and config.json, and
    the ``audio_config`` it writes back for an export reads as the same tower (also nested as a
    whole ``whole_type`` model's ``thinker_config``)."""
    pp = {"chunk_length": 300, "feature_size": 128, "hop_length": 160, "n_fft": 400, "sampling_rate": 16000,
          "nb_max_frames": 30000, "feature_extractor_type": "WhisperFeatureExtractor"}
    assert cls.params_from_preprocessor_config(pp) == {
        "sampling_rate": 16000, "n_fft": 400, "hop_length": 160, "max_frames": 30000}
    enc = cls.from_pretrained(path, max_frames=3000)
    assert (enc.config.d_model, enc.config.encoder_layers, enc.config.max_frames) == (d_model, 2, 3000)
    exported = enc.hf_audio_config(out_dim)
    saved = json.loads((Path(path) / "config.json").read_text())["audio_config"]
    assert exported == {k: v for k, v in saved.items() if k in exported}
    again = cls.params_from_hf_config({"model_type": whole_type, "thinker_config": {"audio_config": exported}})
    assert cls.build_config({**again, "max_frames": 3000}) == enc.config


def audio_tower_rows(cls, plugin: str, path, clips):
    """An Omni audio tower plugin ``cls`` loaded from ``path`` with its projector as Omni builds
    it (``build_projector``), run on packed ``clips`` (mel frames each): (tower, projector, the
    tower's rows, the projected rows)."""
    from omni.models.build import build_projector
    from omni.models.config import EncoderSlot

    enc = cls.from_pretrained(path).eval()
    held = cls.pretrained_projector(path)
    proj, source = build_projector("audio", EncoderSlot(name=plugin, pretrained=path), enc, held.out_dim)
    assert source is not None
    proj = proj.to_empty(device="cpu")
    proj.load_state_dict(source.tensors)
    sizes = torch.tensor([[c.shape[0]] for c in clips])
    with torch.no_grad():
        rows = enc(torch.cat(clips), sizes)
        return enc, proj, rows, proj(rows, sizes)


def as_whole_model(src, tower, path: Path, model_type: str, **audio) -> str:
    """The released layout of a thinker saved at ``src`` (its audio ``tower`` alone): model_type
    ``model_type``, the config nested as ``thinker_config`` (``audio``: audio_config entries
    changed), the tower's weights under ``thinker.audio_tower.``."""
    from safetensors.torch import save_file

    thinker = json.loads((Path(src) / "config.json").read_text())
    thinker["audio_config"].update(audio)
    (path / "config.json").write_text(json.dumps({
        "model_type": model_type, "thinker_config": thinker, "enable_audio_output": False,
        "transformers_version": thinker.get("transformers_version")}))
    save_file({f"thinker.audio_tower.{k}": v.contiguous() for k, v in tower.state_dict().items()},
              str(path / "model.safetensors"))
    return str(path)


def mel_clips(frames, mel: int, seed: int = 0) -> list:
    """Random mel features [f, mel] for each clip length in ``frames`` (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(f, mel, generator=g) for f in frames]


def saved_thinker(model, tmp_path_factory, name: str):
    """A thinker ``model`` (drawn large, seeded) saved by transformers to a fresh folder
    ``name``: (the folder, its audio tower)."""
    model = drawn_large(model)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path), model.model.audio_tower
