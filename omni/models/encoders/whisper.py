"""Whisper-encoder-compatible audio encoder on packed, variable-length clips.

Unlike transformers' WhisperEncoder, clips are *not* padded to 30 s: each clip yields the
log-mel frames of its own samples, several clips are packed into one sequence, the two
convolutions run without bleeding across clips, each clip gets positions 0..n-1 of the
(sinusoidal) position table, and attention stays inside each clip.

Clips longer than ``max_frames`` mel frames (default 2 * max_source_positions, i.e. 30 s for
Whisper) are rejected with a clear error by the processor (and by the token count from
metadata), unless the data source sets ``audio: {chunk_seconds: S}``: then a long clip is cut
into equal chunks of at most S seconds, each encoded as its own clip, and their outputs fill
the clip's placeholder one after the other.
"""
import copy
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dataloading.formats.media import MediaItem
from parallel.transfer import to_device
from omni.models.encoders.base import EncoderAnchor, check_sizes
from omni.models.encoders.resample import resample
from omni.models.encoders.blocks import (AttentionSpec, activation, packed_self_attention,
                                         transformer_activation_bytes, transformer_flops)


@dataclass
class WhisperEncoderConfig:
    """Defaults follow transformers' WhisperConfig (whisper-tiny-sized encoder)."""

    num_mel_bins: int = 80
    d_model: int = 384
    encoder_layers: int = 4
    encoder_attention_heads: int = 6
    encoder_ffn_dim: int = 1536
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    # preprocessing (WhisperFeatureExtractor's names)
    sampling_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    max_frames: Optional[int] = None  # longest clip in mel frames; None: 2 * max_source_positions

    def __post_init__(self) -> None:
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(
                f"d_model {self.d_model} is not a multiple of encoder_attention_heads {self.encoder_attention_heads}"
            )
        if self.max_frames is None:
            self.max_frames = 2 * self.max_source_positions
        if not 1 <= self.max_frames <= 2 * self.max_source_positions:
            raise ValueError(
                f"max_frames {self.max_frames} must be in [1, 2 * max_source_positions = {2 * self.max_source_positions}]"
            )
        activation(self.activation_function)


def check_widths(d_model: int, heads: int) -> None:
    """An audio tower's width: whole heads, and an even width (sin and cos halves of its
    sinusoidal positions)."""
    if d_model % heads:
        raise ValueError(f"d_model {d_model} is not a multiple of encoder_attention_heads {heads}")
    if d_model % 2 or d_model < 4:
        raise ValueError(f"d_model {d_model} must be even and >= 4 (sin and cos halves of the positions)")


def output_frames(n_frames: int) -> int:
    """Tokens after the stride-2 conv (kernel 3, padding 1) over ``n_frames`` mel frames."""
    return (n_frames - 1) // 2 + 1


class WhisperProcessor:
    """(float32 waveform [n], sample_rate) -> log-mel frames [n // hop_length, num_mel_bins].

    The same computation as transformers' WhisperFeatureExtractor (torch path: centred
    reflect-padded STFT with a periodic Hann window, drop the last frame, power spectrum,
    Slaney mel filters up to 8 kHz, log10 clamped at 1e-10, floor at max - 8, (x + 4) / 4) on
    the clip's own samples, without padding to 30 s. So the dynamic-range floor uses the clip's
    own maximum. Other sample rates are resampled (:func:`resample`); stereo is averaged.
    """

    modality = "audio"

    def __init__(self, config: WhisperEncoderConfig):
        from transformers.audio_utils import mel_filter_bank  # only here: workers get the array

        self.config = config  # the STFT and mel settings: sampling_rate, n_fft, hop_length, num_mel_bins, max_frames
        self.chunk_samples: Optional[int] = None  # set per data source by with_options(chunk_seconds=...)
        self.mel_filters = mel_filter_bank(
            num_frequency_bins=1 + config.n_fft // 2,
            num_mel_filters=config.num_mel_bins,
            min_frequency=0.0,
            max_frequency=8000.0,
            sampling_rate=config.sampling_rate,
            norm="slaney",
            mel_scale="slaney",
        )

    def with_options(self, chunk_seconds: Optional[float] = None) -> "WhisperProcessor":
        """A copy with one data source's settings (mixture file ``audio:`` options)."""
        other = copy.copy(self)
        if chunk_seconds is not None:
            if not 0 < chunk_seconds <= self.longest_s:
                raise ValueError(f"audio chunk_seconds={chunk_seconds} must be in (0, {self.longest_s:g}] (max_frames)")
            other.chunk_samples = int(chunk_seconds * self.config.sampling_rate)
        return other

    @property
    def longest_s(self) -> float:
        """The longest clip in seconds (``max_frames`` mel frames)."""
        c = self.config
        return c.max_frames * c.hop_length / c.sampling_rate

    def chunk_bounds(self, n: int) -> List[Tuple[int, int]]:
        """Sample ranges of the chunks of a clip of ``n`` samples at ``sampling_rate``: equal
        lengths (so no tiny last chunk), each at most ``chunk_samples``."""
        if self.chunk_samples is None or n <= self.chunk_samples:
            return [(0, n)]
        k = -(-n // self.chunk_samples)
        cuts = [round(i * n / k) for i in range(k + 1)]
        return list(zip(cuts[:-1], cuts[1:]))

    def num_frames(self, num_samples: int, sample_rate: int) -> int:
        """Mel frames of a clip, after resampling to ``sampling_rate``; raises for clips that
        are too short for the STFT or longer than ``max_frames``."""
        c, n = self.config, int(num_samples)
        if int(sample_rate) != c.sampling_rate:
            n = -(-n * c.sampling_rate // int(sample_rate))
        if n <= c.n_fft // 2:
            raise ValueError(
                f"audio clip too short: {n} samples at {c.sampling_rate} Hz; "
                f"need more than n_fft/2 = {c.n_fft // 2}"
            )
        frames = n // c.hop_length
        if frames > c.max_frames:
            raise ValueError(
                f"audio clip too long: {frames} mel frames ({n / c.sampling_rate:.2f} s) > max_frames "
                f"{c.max_frames} ({self.longest_s:.2f} s); "
                "split it into shorter clips upstream or raise max_frames (at most 2 * max_source_positions)"
            )
        return frames

    def tokens_of(self, frames: int) -> int:
        """LLM tokens of a clip of ``frames`` mel frames (the tower's output rows)."""
        return output_frames(frames)

    def num_tokens_from_meta(self, meta: Dict[str, Any]) -> int:
        n, sr = int(meta["num_samples"]), int(meta["sample_rate"])
        if self.chunk_samples is not None and sr != self.config.sampling_rate:
            n = -(-n * self.config.sampling_rate // sr)  # chunking happens after resampling
            sr = self.config.sampling_rate
        return sum(self.tokens_of(self.num_frames(b - a, sr)) for a, b in self.chunk_bounds(n))

    def log_mel(self, wave: np.ndarray) -> torch.Tensor:
        """[n] float32 samples at ``sampling_rate`` -> [num_mel_bins, n // hop_length]."""
        x = torch.from_numpy(np.ascontiguousarray(wave)).to(torch.float32)
        window = torch.hann_window(self.config.n_fft)
        stft = torch.stft(x, self.config.n_fft, self.config.hop_length, window=window, return_complex=True)
        magnitudes = (stft[..., :-1].abs() ** 2).contiguous()
        mel = torch.from_numpy(self.mel_filters).to(torch.float32).T @ magnitudes
        log_spec = torch.clamp(mel, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return (log_spec + 4.0) / 4.0

    def __call__(self, raw: Any) -> MediaItem:
        try:
            wave, sample_rate = raw
        except (TypeError, ValueError):
            raise ValueError("audio input must be a (waveform, sample_rate) pair") from None
        wave = np.asarray(wave, dtype=np.float32)
        if wave.ndim == 2:  # [n, channels]
            wave = wave.mean(axis=1)
        if wave.ndim != 1:
            raise ValueError(f"waveform must be [n] or [n, channels], got shape {tuple(wave.shape)}")
        if self.chunk_samples is None:
            self.num_frames(wave.shape[0], sample_rate)  # too short or too long: fail before resampling
        if int(sample_rate) != self.config.sampling_rate:
            wave = resample(wave, int(sample_rate), self.config.sampling_rate)
        items = []
        for a, b in self.chunk_bounds(wave.shape[0]):
            frames = self.num_frames(b - a, self.config.sampling_rate)
            feats = self.log_mel(wave[a:b]).T.contiguous()  # [frames, mel]
            assert feats.shape[0] == frames
            items.append(MediaItem(features=feats, size=(frames,), num_tokens=self.tokens_of(frames)))
        return items[0] if len(items) == 1 else items


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's sinusoidal position table [length, channels] (sin half, then cos half)."""
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2))
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1)


class _Attention(nn.Module):
    def __init__(self, config: WhisperEncoderConfig):
        super().__init__()
        d = config.d_model
        self.num_heads = config.encoder_attention_heads
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d)
        self.q_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, attention: AttentionSpec) -> torch.Tensor:
        return packed_self_attention(
            x, self.q_proj, self.k_proj, self.v_proj, self.out_proj, self.num_heads, attention, prescale_q=True
        )


class _Layer(nn.Module):
    def __init__(self, config: WhisperEncoderConfig):
        super().__init__()
        d = config.d_model
        self.self_attn = _Attention(config)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.act = activation(config.activation_function)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, attention: AttentionSpec) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), attention)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class MelFrameTower:
    """What the packed mel-frame towers share (Whisper's, Qwen2.5-Omni's, Qwen3-Omni's audio
    towers): an item is a clip of mel frames (``sizes[:, 0]``), its tokens run through ``layers``."""

    def conv_stem(self, config) -> None:
        """Whisper's two convolutions (the second strides by 2) into ``d_model``, its output width."""
        d = config.d_model
        self.output_dim = d
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)

    def clip_frames(self, features: torch.Tensor, sizes: torch.Tensor, least: int) -> List[int]:
        """The clips' mel frames, checked in one line each: features [frames, num_mel_bins], as
        many rows as the sizes say, every clip at least ``least`` frames (one LLM token)."""
        name, mel = type(self).__name__, self.config.num_mel_bins
        if features.dim() != 2 or features.shape[1] != mel:
            raise ValueError(f"{name}: features must be [frames, num_mel_bins = {mel}], got {tuple(features.shape)}")
        frames = check_sizes(name, features, self.input_units(sizes))
        if frames and min(frames) < least:
            raise ValueError(f"{name}: a clip of {min(frames)} mel frames makes no LLM token (need >= {least})")
        return frames

    def encode_tokens(self, x: torch.Tensor, attention: AttentionSpec) -> torch.Tensor:
        """The layers; ``attention``: the segments tokens attend within (``item_attention``)."""
        return self.run_layers(self.layers, x, attention)

    def attention_heads(self) -> int:
        return self.config.encoder_attention_heads

    def input_units(self, sizes: torch.Tensor) -> List[int]:
        """Mel frames per clip (feature rows)."""
        return [int(n) for n in sizes[:, 0].tolist()]

    def layer_modules(self) -> List[nn.Module]:
        return list(self.layers)


class WhisperEncoder(MelFrameTower, EncoderAnchor):
    """Packed Whisper audio encoder; output: final-layernorm hidden states, one token per two
    mel frames. Parameter names equal transformers' WhisperEncoder."""

    modality: ClassVar[str] = "audio"
    Config: ClassVar[type] = WhisperEncoderConfig
    hf_model_types: ClassVar[Tuple[str, ...]] = ("whisper",)
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = ("model.encoder.", "encoder.", "")
    supports_sequence_parallel: ClassVar[bool] = True

    def __init__(self, config: WhisperEncoderConfig):
        super().__init__(config)
        d = config.d_model
        self.conv_stem(config)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        with torch.no_grad():
            self.embed_positions.weight.copy_(sinusoids(config.max_source_positions, d))
        self.embed_positions.requires_grad_(False)  # fixed, as in Whisper
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def init_rule(self, owner: nn.Module, path: str, attr: str):
        """The fixed sinusoidal position table; the rest takes torch's defaults
        (``omni.models.materialize``)."""
        if path == "embed_positions" and attr == "weight":
            from omni.models.materialize import Computed

            c = self.config
            return Computed(lambda: sinusoids(c.max_source_positions, c.d_model))
        return None

    @classmethod
    def processor(cls, config: WhisperEncoderConfig) -> WhisperProcessor:
        return WhisperProcessor(cls.build_config(config))

    @classmethod
    def params_from_preprocessor_config(cls, pp_config: Dict[str, Any]) -> Dict[str, Any]:
        return {k: int(pp_config[k]) for k in ("sampling_rate", "n_fft", "hop_length") if k in pp_config}

    def _layout(self, frames: List[int], device: torch.device) -> Tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Lay the clips out in one zero-separated row so that one conv call equals per-clip
        convs: each clip starts at an even offset and is followed by >= 1 zero frame.
        Returns (row length, input index per frame, output index per token, position per token)."""
        slots = [t + (2 if t % 2 == 0 else 1) for t in frames]
        starts = np.concatenate([[0], np.cumsum(slots)[:-1]]).astype(np.int64)
        lens = np.asarray(frames, dtype=np.int64)
        outs = (lens - 1) // 2 + 1
        in_idx = np.repeat(starts, lens) + _local(lens)
        pos = _local(outs)
        out_idx = np.repeat(starts // 2, outs) + pos
        # built on the host from the sizes, moved in one batched copy
        in_idx, out_idx, pos = to_device([torch.from_numpy(a) for a in (in_idx, out_idx, pos)], device)
        return int(sum(slots)), in_idx, out_idx, pos

    def embed_inputs(self, features: torch.Tensor, sizes: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
        """conv1 + conv2 over the zero-separated clip layout, plus positions 0..n-1 per clip."""
        if sizes.shape[0] == 0:
            return features.new_zeros(0, self.output_dim, dtype=self.layer_norm.weight.dtype), []
        frames = check_sizes("WhisperEncoder", features, self.input_units(sizes))
        tokens = [output_frames(t) for t in frames]
        if max(tokens, default=0) > self.config.max_source_positions:
            raise ValueError(
                f"WhisperEncoder: a clip of {max(frames)} mel frames exceeds max_source_positions "
                f"{self.config.max_source_positions} (at most {2 * self.config.max_source_positions} frames)"
            )
        if min(frames, default=1) < 1:
            raise ValueError("WhisperEncoder: every clip needs at least one mel frame")
        length, in_idx, out_idx, pos = self._layout(frames, features.device)
        dtype = self.conv1.weight.dtype
        row = features.new_zeros(length, features.shape[1], dtype=dtype).index_copy(0, in_idx, features.to(dtype))
        mask = torch.zeros(length, dtype=dtype, device=features.device).index_fill(0, in_idx, 1.0)
        h = F.gelu(self.conv1(row.T[None])) * mask  # zero the separators again
        h = F.gelu(self.conv2(h))[0].T  # [ceil(length/2), D]
        return h.index_select(0, out_idx) + self.embed_positions(pos), tokens

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(x)

    def activation_bytes(self, tokens: int, element_bytes: int = 4) -> float:
        c = self.config
        return transformer_activation_bytes(c.encoder_layers, c.d_model, c.encoder_ffn_dim, tokens, element_bytes,
                                            self.activation_checkpoint)

    def cost_coefficients(self) -> Tuple[float, float]:
        c = self.config
        alpha, beta = transformer_flops(c.encoder_layers, c.d_model, c.encoder_ffn_dim)
        # conv1 runs on 2 frames per token (2*3*mel*d FLOPs each), conv2 once per token.
        beta += 2 * 2.0 * 3 * c.num_mel_bins * c.d_model + 2.0 * 3 * c.d_model * c.d_model
        return alpha, beta


def _local(lengths: np.ndarray) -> np.ndarray:
    """0..l-1 for each l in ``lengths``, concatenated."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=np.int64) - starts
