"""The audio tower of Qwen3-Omni's thinker (plugin ``qwen3_omni_audio``) on packed clips.

What transformers' ``Qwen3OmniMoeAudioEncoder`` computes, clip by clip:

- the mel frames are cut into chunks of ``W = 2 * n_window`` frames (the last one shorter),
  each right-padded with zeros to ``W`` and seen as a 1-channel image [num_mel_bins, W];
- three Conv2d (3x3, stride 2, padding 1, each followed by GELU) halve mel and time three times,
  then ``conv_out`` (a Linear without bias) maps each time column's channels x mel values to
  ``d_model``: ``conv_tokens(W)`` tokens per full chunk (13 for n_window 50). Nothing masks the
  padding between the convolutions: the padded columns hold GELU(bias) after the first one,
  and the last token of a short chunk reads them. transformers pads to the longest chunk of
  its batch; here every chunk is padded to ``W``: its result whenever its batch holds a full
  chunk, and so the same rows for a clip alone or packed (transformers differs there for a
  clip shorter than ``W`` run alone, where there is no padding);
- sinusoidal positions 0..n-1 *per chunk* (they restart every ``W`` frames);
- attention within windows of ``n_window_infer // W`` consecutive chunks of a clip (the
  ``cu_seqlens`` transformers builds), the last window shorter;
- ``ln_post``; then ``proj1`` -> activation -> ``proj2`` into the LLM width, which in Omni is
  the projector: its ``Projector`` (no norm, fc1 = proj1 [d_model -> d_model], the config's
  activation, fc2 = proj2), loaded by ``pretrained_projector``.

So a clip of F mel frames gives ``llm_tokens(F)`` rows (no pooling). transformers' count
(``_get_feat_extract_output_lengths``) writes 13 for a full chunk: the same for n_window 49..52,
the only settings its tower runs with; Omni counts ``conv_tokens(W)``, right for any n_window.

The processor is :class:`~omni.models.encoders.whisper.WhisperProcessor`'s log-mel: Qwen3-Omni's
processor calls WhisperFeatureExtractor with ``padding=True`` and ``truncation=False`` (not
Qwen2.5-Omni's ``max_length``), so one clip is the STFT of its own samples, F = n // hop_length
frames; only the token count and the limits' messages are this tower's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from parallel.transfer import to_device
from omni.models.encoders.base import EncoderAnchor
from omni.models.encoders.blocks import activation, transformer_activation_bytes, transformer_flops
from omni.models.encoders.qwen3_omni_vision import OMNI3_MODEL_TYPES, thinker_config
from omni.models.encoders.qwen_omni_audio import QwenOmniAudioEncoder
# Whisper's layer: transformers' Qwen3-Omni audio layer's names and math (pre-norm); _local:
# 0..l-1 per length. Shared, not copied.
from omni.models.encoders.whisper import MelFrameTower, WhisperProcessor, _Layer, _local, check_widths, sinusoids
from omni.models.projector import ACTIVATIONS, PretrainedProjector


@dataclass
class Qwen3OmniAudioConfig:
    """Defaults follow Qwen3-Omni-30B-A3B's audio tower; ``from_pretrained`` reads a checkpoint's.
    The layer fields have the names ``whisper._Layer`` reads."""

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    max_source_positions: int = 1500  # rows of the sinusoid table; a chunk uses conv_tokens(2 * n_window)
    n_window: int = 50  # a chunk is 2 * n_window mel frames
    n_window_infer: int = 800  # mel frames per attention window: n_window_infer // (2 * n_window) chunks
    conv_chunksize: int = 500  # chunks per convolution call (memory only, as in transformers)
    downsample_hidden_size: int = 480  # channels of the three Conv2d
    activation_function: str = "gelu"  # the layers' MLP and the projector's
    # preprocessing (WhisperFeatureExtractor's names)
    sampling_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    # The longest clip in mel frames (300 s: the released preprocessor_config.json's chunk_length;
    # transformers does not truncate, so this is a budget only).
    max_frames: int = 30000

    def __post_init__(self) -> None:
        check_widths(self.d_model, self.encoder_attention_heads)
        if self.n_window < 1 or conv_tokens(2 * self.n_window) > self.max_source_positions:
            raise ValueError(f"n_window {self.n_window} must be >= 1 with its chunk's {conv_tokens(2 * self.n_window)} "
                             f"tokens <= max_source_positions {self.max_source_positions}")
        if self.n_window_infer < 2 * self.n_window:
            raise ValueError(f"n_window_infer {self.n_window_infer} must be >= 2 * n_window = {2 * self.n_window} "
                             "(an attention window holds whole chunks)")
        for name in ("conv_chunksize", "downsample_hidden_size", "num_mel_bins", "max_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        activation(self.activation_function)


#: The architecture fields of transformers' Qwen3OmniMoeAudioEncoderConfig that Config shares.
_HF_KEYS = ("num_mel_bins", "d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
            "max_source_positions", "n_window", "n_window_infer", "conv_chunksize", "downsample_hidden_size",
            "activation_function")


def halve(n, times: int = 3):
    """Length after ``times`` stride-2 convolutions (kernel 3, padding 1): ceil(n / 2**times); 0 stays 0."""
    for _ in range(times):
        n = (n - 1) // 2 + 1
    return n


def conv_tokens(frames: int) -> int:
    """Tokens of one chunk of ``frames`` mel frames (the three convolutions)."""
    return halve(frames)


def llm_tokens(frames: int, n_window: int = 50) -> int:
    """Output rows (LLM tokens) of a clip of ``frames`` mel frames: its chunks' tokens."""
    w = 2 * n_window
    return frames // w * conv_tokens(w) + conv_tokens(frames % w)


class Qwen3OmniAudioProcessor(WhisperProcessor):
    """(float32 waveform [n], sample_rate) -> log-mel frames [n // hop_length, num_mel_bins]:
    WhisperFeatureExtractor on the clip alone, as Qwen3-Omni's processor calls it (resampling,
    stereo, ``chunk_seconds``, the checks: :class:`WhisperProcessor`'s); ``num_tokens`` is
    ``llm_tokens``. Clips of more than ``max_frames`` frames are refused."""

    def num_frames(self, num_samples: int, sample_rate: int) -> int:
        c, n = self.config, int(num_samples)
        if int(sample_rate) != c.sampling_rate:
            n = -(-n * c.sampling_rate // int(sample_rate))
        if n // c.hop_length > c.max_frames:
            raise ValueError(
                f"audio clip too long: {n // c.hop_length} mel frames ({n / c.sampling_rate:.2f} s) > max_frames "
                f"{c.max_frames} ({self.longest_s:.2f} s); split it into shorter clips upstream, set the source's "
                "audio chunk_seconds, or raise max_frames")
        return super().num_frames(num_samples, sample_rate)  # too short for the STFT: Whisper's message

    def tokens_of(self, frames: int) -> int:
        """The tokens of the clip's chunks (``llm_tokens``)."""
        return llm_tokens(frames, self.config.n_window)


class _Layer3(_Layer):
    """Whisper's layer with the bias on k_proj that transformers' Qwen3-Omni layer has."""

    def __init__(self, config: Qwen3OmniAudioConfig):
        super().__init__(config)
        self.self_attn.k_proj = nn.Linear(config.d_model, config.d_model)


class Qwen3OmniAudioEncoder(MelFrameTower, EncoderAnchor):
    """Qwen3-Omni audio tower up to ``ln_post`` (proj1/act/proj2 is the projector).

    ``forward(features [sum F, num_mel_bins], sizes int64 [n, 1] = F per clip)`` ->
    ``[sum llm_tokens(F), d_model]``. Parameter names equal transformers' below the tower's prefix."""

    modality: ClassVar[str] = "audio"
    Config: ClassVar[type] = Qwen3OmniAudioConfig
    hf_model_types: ClassVar[Tuple[str, ...]] = OMNI3_MODEL_TYPES
    # released checkpoints and transformers 5's save of the whole model: thinker.audio_tower;
    # its save of a thinker alone: audio_tower; the thinker's in-memory name: model.audio_tower
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = ("thinker.audio_tower.", "model.audio_tower.", "audio_tower.")
    # Not sequence-parallel: attention is inside windows of chunks, not over the item as the
    # Ulysses path computes it; nor needed: the cost is linear in the clip's length.
    supports_sequence_parallel: ClassVar[bool] = False

    def __init__(self, config: Qwen3OmniAudioConfig):
        super().__init__(config)
        d, ch = config.d_model, config.downsample_hidden_size
        self.output_dim = d
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv_out = nn.Linear(ch * halve(config.num_mel_bins), d, bias=False)
        self.layers = nn.ModuleList(_Layer3(config) for _ in range(config.encoder_layers))
        self.ln_post = nn.LayerNorm(d)

    @classmethod
    def processor(cls, config: Qwen3OmniAudioConfig) -> Qwen3OmniAudioProcessor:
        return Qwen3OmniAudioProcessor(cls.build_config(config))

    # --- the model ---------------------------------------------------------------------------
    def forward(self, features: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        frames = self.clip_frames(features, sizes, least=1)
        if not frames:
            return self.ln_post(features.new_zeros(0, self.config.d_model, dtype=self.ln_post.weight.dtype))
        x, windows = self.embed_chunks(features, frames)
        return self.finish(self.encode_tokens(x, self.item_attention(windows, x.device)))

    def embed_chunks(self, features: torch.Tensor, frames: List[int]) -> Tuple[torch.Tensor, List[int]]:
        """The convolutions per chunk (each zero-padded to 2 * n_window frames), conv_out and
        positions 0..n-1 per chunk. Returns (token states [T, D], tokens per attention window)."""
        c = self.config
        w, per_chunk = 2 * c.n_window, conv_tokens(2 * c.n_window)
        lens = np.concatenate([[w] * (f // w) + ([f % w] if f % w else []) for f in frames]).astype(np.int64)
        toks = halve(lens)
        in_idx = np.repeat(np.arange(len(lens)) * w, lens) + _local(lens)
        out_idx = np.repeat(np.arange(len(lens)) * per_chunk, toks) + _local(toks)
        in_idx, out_idx = to_device([torch.from_numpy(a) for a in (in_idx, out_idx)], features.device)
        dtype = self.conv2d1.weight.dtype
        rows = features.new_zeros(len(lens) * w, c.num_mel_bins, dtype=dtype).index_copy(0, in_idx, features.to(dtype))
        rows = rows.view(len(lens), w, c.num_mel_bins).transpose(1, 2)[:, None]  # [chunks, 1, mel, W]
        parts = []
        for part in rows.split(c.conv_chunksize):  # as transformers, to bound the convolutions' memory
            part = F.gelu(self.conv2d2(F.gelu(self.conv2d1(part))))
            parts.append(F.gelu(self.conv2d3(part)))
        h = torch.cat(parts)
        b, ch, mel, t = h.shape
        h = self.conv_out(h.permute(0, 3, 1, 2).reshape(b, t, ch * mel))
        # The fixed sinusoid table (a non-persistent buffer in transformers): only the rows a chunk uses.
        h = h + sinusoids(t, c.d_model).to(h.device, h.dtype)
        return h.reshape(-1, c.d_model).index_select(0, out_idx), self.windows(frames)

    def windows(self, frames: List[int]) -> List[int]:
        """Tokens per attention window, clip after clip: windows of ``n_window_infer // W``
        chunks from each clip's start (transformers' cu_seqlens; its window, the longest chunk's
        tokens times that ratio, is this one whenever a clip has two chunks or more, and longer
        than every clip otherwise)."""
        c = self.config
        size = conv_tokens(2 * c.n_window) * (c.n_window_infer // (2 * c.n_window))
        out = []
        for f in frames:
            n = llm_tokens(f, c.n_window)
            out += [size] * (n // size) + ([n % size] if n % size else [])
        return out

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_post(x)

    # --- the planner's and the simulator's view ---------------------------------------------------

    def feature_width(self) -> int:
        """Mel values per output row: a full chunk's frames over its tokens (about 8 frames)."""
        w = 2 * self.config.n_window
        return round(self.config.num_mel_bins * w / conv_tokens(w))

    def _stem(self) -> Tuple[float, float]:
        """(FLOPs, values kept for backward) of the convolutions and conv_out, per output row
        (a chunk's, padded to W frames, over its conv_tokens(W) rows)."""
        c = self.config
        w, ch, d = 2 * c.n_window, c.downsample_hidden_size, c.d_model
        maps = [halve(c.num_mel_bins, i) * halve(w, i) for i in (1, 2, 3)]  # mel x time after each conv
        flops = 2.0 * 9 * ch * (maps[0] + ch * maps[1] + ch * maps[2]) + 2.0 * ch * maps[2] * d
        kept = c.num_mel_bins * w + 2.0 * ch * sum(maps) + ch * maps[2] + d * halve(w)
        return flops / conv_tokens(w), kept / conv_tokens(w)

    def activation_bytes(self, tokens: int, element_bytes: int = 4) -> float:
        """The layers' (``tokens`` output rows, one layer token each) plus the convolutions'
        (never recomputed)."""
        c = self.config
        return (transformer_activation_bytes(c.encoder_layers, c.d_model, c.encoder_ffn_dim, tokens, element_bytes,
                                             self.activation_checkpoint)
                + tokens * self._stem()[1] * element_bytes)

    def cost_coefficients(self) -> Tuple[float, float]:
        """Per output row, all linear: a token attends within its window (at most
        conv_tokens(W) * (n_window_infer // W) tokens), so the attention's n^2 term is that times n."""
        c = self.config
        alpha, beta = transformer_flops(c.encoder_layers, c.d_model, c.encoder_ffn_dim)
        window = conv_tokens(2 * c.n_window) * (c.n_window_infer // (2 * c.n_window))
        return 0.0, beta + alpha * window + self._stem()[0]

    # --- checkpoints -------------------------------------------------------------------------
    @staticmethod
    def audio_config_of(hf_config: Dict[str, Any]) -> Dict[str, Any]:
        """``thinker_config.audio_config`` of a whole model (qwen3_omni_moe), ``audio_config`` of
        a thinker (qwen3_omni_moe_thinker)."""
        return dict(thinker_config(hf_config).get("audio_config") or {})

    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        # scale_embedding is not read: transformers computes embed_scale but never applies it.
        a = cls.audio_config_of(hf_config)
        return {k: a[k] for k in _HF_KEYS if a.get(k) is not None}

    def hf_audio_config(self, out_dim: int) -> Dict[str, Any]:
        """The checkpoint's ``audio_config`` of this tower, whose proj2 maps into ``out_dim`` (export)."""
        c = self.config
        return {**{k: getattr(c, k) for k in _HF_KEYS}, "output_dim": int(out_dim)}

    @classmethod
    def params_from_preprocessor_config(cls, pp_config: Dict[str, Any]) -> Dict[str, Any]:
        """The STFT settings, and max_frames from chunk_length (Qwen2.5-Omni's reading, shared)."""
        return QwenOmniAudioEncoder.params_from_preprocessor_config(pp_config)

    @classmethod
    def pretrained_projector(cls, path: str) -> Optional[PretrainedProjector]:
        """proj1 -> act -> proj2 as Omni's ``Projector`` (no norm, fc1 = proj1, fc2 = proj2)."""
        from omni.models.hf_checkpoint import CheckpointReader, read_hf_config

        audio = cls.audio_config_of(read_hf_config(path))
        reader = CheckpointReader(path)
        prefix = next((p for p in cls.hf_weight_prefixes if p + "proj1.weight" in reader), None)
        if prefix is None:
            return None
        act = audio.get("activation_function", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"the audio tower's proj1 -> {act} -> proj2 does not fit Omni's Projector (activations "
                             f"{', '.join(sorted(ACTIVATIONS))}); set projector.pretrained=false for a fresh one")
        names = {f"fc{i}.{k}": f"{prefix}proj{i}.{k}" for i in (1, 2) for k in ("weight", "bias")}
        return PretrainedProjector(out_dim=int(audio.get("output_dim", 3584)),
                                   hidden=int(audio.get("d_model", Qwen3OmniAudioConfig.d_model)), activation=act,
                                   names=names)

    def fresh_projector(self) -> Dict[str, Any]:
        """The family's shape (proj1 keeps d_model, the config's activation), so that a tower
        trained from scratch has the checkpoint's projector."""
        return {"hidden": self.config.d_model, "activation": self.config.activation_function}
