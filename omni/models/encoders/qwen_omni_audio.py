"""The audio tower of Qwen2.5-Omni's thinker on packed, variable-length clips.

A Whisper-style encoder (transformers' ``Qwen2_5OmniAudioEncoder``) with three differences
from :mod:`omni.models.encoders.whisper`:

- a clip's mel frames are cut into chunks of ``2 * n_window`` frames (the last one shorter);
  each chunk goes through the two convolutions on its own, gets sinusoidal positions 0..n-1 of
  its own, and attention stays inside each chunk. So attention cost is linear in the clip's
  length, and a clip may be far longer than ``max_source_positions`` (only the processor's
  ``max_frames`` bounds it);
- after the layers, each *clip's* tokens (its chunks' tokens one after the other) are averaged
  in pairs (an odd last token is dropped), then ``ln_post``: one row per LLM token, so a clip
  of F mel frames gives ``((F - 1) // 2 + 1) // 2`` rows;
- ``proj`` (a Linear into the LLM width) is this tower's projector in Omni
  (:class:`LinearProjector`, loaded from the checkpoint by ``pretrained_projector``).

The processor is Whisper's log-mel on the clip padded with zeros as transformers' extractor
pads it (to ``max_frames`` frames, 300 s in Qwen2.5-Omni), keeping ``ceil(n / hop_length)``
frames: what Qwen2.5-Omni's processor's ``feature_attention_mask`` counts.
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
# Whisper's layer has transformers' Qwen2.5-Omni layer's parameter names and math (pre-norm,
# k_proj without bias); _local: 0..l-1 per length. Shared, not copied.
from omni.models.encoders.whisper import MelFrameTower, WhisperProcessor, _Layer, _local, check_widths, sinusoids
from omni.models.projector import PretrainedProjector


@dataclass
class QwenOmniAudioConfig:
    """Defaults follow Qwen2.5-Omni-7B's audio tower and processor; ``from_pretrained`` reads a
    checkpoint's. The layer fields have the names ``whisper._Layer`` reads."""

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    max_source_positions: int = 1500  # rows of the sinusoid table; a chunk uses its first n_window
    n_window: int = 100  # a chunk is 2 * n_window mel frames, n_window tokens after the stride-2 conv
    activation_function: str = "gelu"
    # preprocessing (WhisperFeatureExtractor's names)
    sampling_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    # The longest clip in mel frames, and the length transformers' extractor zero-pads every clip
    # to (its nb_max_frames: chunk_length 300 s in Qwen2.5-Omni's preprocessor_config.json).
    max_frames: int = 30000
    # Width of the checkpoint's ``audio_bos_eos_token`` table (its output_dim): the thinker never
    # reads it, the tower keeps it (a buffer) so that an export writes it back bit for bit;
    # 0: none (a tower built from scratch).
    bos_eos_width: int = 0

    def __post_init__(self) -> None:
        check_widths(self.d_model, self.encoder_attention_heads)
        if not 1 <= self.n_window <= self.max_source_positions:
            raise ValueError(f"n_window {self.n_window} must be in [1, max_source_positions = "
                             f"{self.max_source_positions}]: a chunk's tokens take positions 0..n_window-1")
        if self.max_frames < 3:
            raise ValueError(f"max_frames {self.max_frames} must be >= 3 (3 mel frames make one LLM token)")
        activation(self.activation_function)


#: The architecture fields of transformers' Qwen2_5OmniAudioEncoderConfig that Config shares.
_HF_KEYS = ("num_mel_bins", "d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
            "max_source_positions", "n_window", "activation_function")


def conv_tokens(frames: int) -> int:
    """Tokens after the stride-2 conv over ``frames`` mel frames (the sum over a clip's chunks
    too: every chunk but the last has an even length)."""
    return (frames - 1) // 2 + 1


def llm_tokens(frames: int) -> int:
    """LLM tokens (output rows) of a clip of ``frames`` mel frames: its conv tokens in pairs
    (transformers' ``_get_feat_extract_output_lengths``, ``((F - 1) // 2 + 1 - 2) // 2 + 1``)."""
    return conv_tokens(frames) // 2


class QwenOmniAudioProcessor(WhisperProcessor):
    """(float32 waveform [n], sample_rate) -> log-mel frames [ceil(n / hop_length), num_mel_bins].

    What Qwen2.5-Omni's processor gives one clip: it calls WhisperFeatureExtractor with
    ``padding="max_length"``, which zero-pads the waveform to ``max_frames * hop_length``
    samples before the STFT, and keeps the frames its attention mask marks (one per hop_length
    samples begun). So the last frames see zeros past the clip, not the clip reflected, and
    the dynamic-range floor (max - 8) is the clip's own maximum (the padding's frames sit at the
    -10 clamp). Resampling, stereo, ``chunk_seconds``: as :class:`WhisperProcessor`, whose
    checks and chunking this reuses. Clips of more than ``max_frames`` frames are refused (the
    extractor would silently truncate them); so are clips of < 3 frames (no LLM token).
    """

    def num_frames(self, num_samples: int, sample_rate: int) -> int:
        c, n = self.config, int(num_samples)
        if int(sample_rate) != c.sampling_rate:
            n = -(-n * c.sampling_rate // int(sample_rate))
        frames = -(-n // c.hop_length)
        if frames > c.max_frames:
            raise ValueError(
                f"audio clip too long: {frames} mel frames ({n / c.sampling_rate:.2f} s) > max_frames {c.max_frames} "
                f"({self.longest_s:.2f} s); split it into shorter clips upstream, set the source's "
                "audio chunk_seconds, or raise max_frames"
            )
        if llm_tokens(frames) < 1:
            raise ValueError(f"audio clip too short: {n} samples at {c.sampling_rate} Hz make {frames} mel frames; "
                             f"one LLM token needs 3 (more than {2 * c.hop_length} samples)")
        return frames

    def tokens_of(self, frames: int) -> int:
        """Whisper's stride-2 tokens, averaged in pairs (``llm_tokens``)."""
        return llm_tokens(frames)

    def log_mel(self, wave: np.ndarray) -> torch.Tensor:
        """[n] samples -> [num_mel_bins, ceil(n / hop_length)], as the extractor computes them on
        the clip zero-padded to max_frames * hop_length samples. Padding to n + n_fft is enough
        (the frames further on see only zeros, and the STFT's end reflection mirrors zeros) unless
        that is past the extractor's length, which then reflects at the same place."""
        c = self.config
        n = wave.shape[0]
        padded = np.zeros(min(c.max_frames * c.hop_length, n + c.n_fft), dtype=np.float32)
        padded[:n] = wave
        return super().log_mel(padded)[:, : -(-n // c.hop_length)]


class LinearProjector(nn.Linear):
    """The tower's ``proj`` (d_model -> LLM width, with bias) as Omni's projector: Omni's
    ``Projector`` is always a two-layer MLP, so it cannot hold this one Linear. Works row by row;
    ``sizes`` (the projector call contract) is not read."""

    def forward(self, x: torch.Tensor, sizes: Optional[torch.Tensor] = None) -> torch.Tensor:
        return super().forward(x)


class _Table(nn.Module):
    """A tensor kept under a module's ``weight`` name as a buffer: carried through loading,
    checkpoints and export, never trained."""

    def __init__(self, rows: int, width: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, width))


class QwenOmniAudioEncoder(MelFrameTower, EncoderAnchor):
    """Qwen2.5-Omni audio tower up to ``ln_post`` (``proj`` is the projector).

    ``forward(features [sum F, num_mel_bins], sizes int64 [n, 1] = F per clip)`` ->
    ``[sum llm_tokens(F), d_model]``. Parameter names equal transformers' below the tower's prefix.
    ``audio_bos_eos_token``, which the thinker's forward never reads, is kept as a buffer
    (``bos_eos_width``) for the export."""

    modality: ClassVar[str] = "audio"
    Config: ClassVar[type] = QwenOmniAudioConfig
    hf_model_types: ClassVar[Tuple[str, ...]] = ("qwen2_5_omni", "qwen2_5_omni_thinker")
    # the released checkpoints (thinker + talker): thinker.audio_tower; transformers 5's
    # save_pretrained of a thinker: audio_tower; its in-memory name: model.audio_tower
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = ("thinker.audio_tower.", "model.audio_tower.", "audio_tower.")
    # Not sequence-parallel: attention is inside chunks of n_window tokens (not over the item,
    # as the Ulysses path computes it), and the pairs pooling needs the whole clip. Nor is it
    # needed: the cost is linear in the clip's length, so a long clip is not a straggler.
    supports_sequence_parallel: ClassVar[bool] = False

    def __init__(self, config: QwenOmniAudioConfig):
        super().__init__(config)
        self.conv_stem(config)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.encoder_layers))
        self.ln_post = nn.LayerNorm(config.d_model)
        if config.bos_eos_width:
            self.audio_bos_eos_token = _Table(2, config.bos_eos_width)

    @classmethod
    def processor(cls, config: QwenOmniAudioConfig) -> QwenOmniAudioProcessor:
        return QwenOmniAudioProcessor(cls.build_config(config))

    # --- the model ---------------------------------------------------------------------------
    def forward(self, features: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        frames = self.clip_frames(features, sizes, least=3)
        if not frames:
            return self.ln_post(features.new_zeros(0, self.config.d_model, dtype=self.ln_post.weight.dtype))
        x, chunk_tokens, pool = self.embed_chunks(features, frames)
        x = self.encode_tokens(x, self.item_attention(chunk_tokens, x.device))
        return self.finish((x.index_select(0, pool) + x.index_select(0, pool + 1)) / 2)

    def embed_chunks(self, features: torch.Tensor, frames: List[int]) -> Tuple[torch.Tensor, List[int], torch.Tensor]:
        """conv1 + conv2 per chunk (chunks side by side, each zero-padded to the longest, as
        transformers does), plus positions 0..n-1 per chunk. Returns (token states [T, D],
        tokens per chunk, index of the first token of each pooled pair)."""
        w = 2 * self.config.n_window
        lens = np.concatenate([[w] * ((f - 1) // w) + [f - (f - 1) // w * w] for f in frames]).astype(np.int64)
        width = int(lens.max())
        toks = (lens - 1) // 2 + 1
        clip_toks = np.asarray([conv_tokens(f) for f in frames], dtype=np.int64)
        pairs = clip_toks // 2
        in_idx = np.repeat(np.arange(len(lens)) * width, lens) + _local(lens)
        out_idx = np.repeat(np.arange(len(lens)) * conv_tokens(width), toks) + _local(toks)
        pool = np.repeat(np.cumsum(clip_toks) - clip_toks, pairs) + 2 * _local(pairs)
        # built on the host from the sizes, moved in one batched copy
        in_idx, out_idx, pool = to_device([torch.from_numpy(a) for a in (in_idx, out_idx, pool)], features.device)
        dtype = self.conv1.weight.dtype
        rows = features.new_zeros(len(lens) * width, features.shape[1], dtype=dtype)
        rows = rows.index_copy(0, in_idx, features.to(dtype)).view(len(lens), width, -1)
        mask = torch.zeros(len(lens) * width, dtype=dtype, device=features.device).index_fill(0, in_idx, 1.0)
        h = F.gelu(self.conv1(rows.transpose(1, 2))) * mask.view(len(lens), 1, width)  # padding stays zero
        h = F.gelu(self.conv2(h)).transpose(1, 2)  # [chunks, conv_tokens(width), D]
        # The fixed sinusoid table (a buffer in transformers, no weight): computed per call, only
        # the rows a chunk uses, so nothing needs materialising off the meta device.
        h = h + sinusoids(h.shape[1], self.config.d_model).to(h.device, h.dtype)
        return h.reshape(-1, h.shape[-1]).index_select(0, out_idx), toks.tolist(), pool

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_post(x)

    # --- the planner's and the simulator's view ---------------------------------------------------

    def feature_width(self) -> int:
        """Four mel frames per output row (two conv tokens, two frames each)."""
        return 4 * self.config.num_mel_bins

    def activation_bytes(self, tokens: int, element_bytes: int = 4) -> float:
        """``tokens``: output rows; the layers run two tokens per row."""
        c = self.config
        return transformer_activation_bytes(c.encoder_layers, c.d_model, c.encoder_ffn_dim, 2 * tokens, element_bytes,
                                            self.activation_checkpoint)

    def cost_coefficients(self) -> Tuple[float, float]:
        """Per output row (two layer tokens, four mel frames), all linear: a token attends
        within its chunk (at most n_window tokens), so the attention's n^2 term is n_window * n."""
        c = self.config
        alpha, beta = transformer_flops(c.encoder_layers, c.d_model, c.encoder_ffn_dim)
        per_token = beta + alpha * c.n_window + 2.0 * 3 * c.d_model * c.d_model  # + conv2
        return 0.0, 2 * per_token + 4 * 2.0 * 3 * c.num_mel_bins * c.d_model  # + conv1

    # --- checkpoints -------------------------------------------------------------------------
    @staticmethod
    def audio_config_of(hf_config: Dict[str, Any]) -> Dict[str, Any]:
        """The audio tower's config in config.json: ``thinker_config.audio_config`` of the whole
        model (qwen2_5_omni), ``audio_config`` of a thinker (qwen2_5_omni_thinker)."""
        return dict((hf_config.get("thinker_config") or hf_config).get("audio_config") or {})

    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        # scale_embedding is not read: transformers computes embed_scale but never applies it.
        a = cls.audio_config_of(hf_config)
        out = {k: a[k] for k in _HF_KEYS if a.get(k) is not None}
        if a.get("output_dim"):
            out["bos_eos_width"] = int(a["output_dim"])
        return out

    def hf_audio_config(self, out_dim: int) -> Dict[str, Any]:
        """The checkpoint's ``audio_config`` of this tower, whose proj maps into ``out_dim`` (export)."""
        c = self.config
        return {**{k: getattr(c, k) for k in _HF_KEYS}, "output_dim": int(out_dim)}

    @classmethod
    def params_from_preprocessor_config(cls, pp_config: Dict[str, Any]) -> Dict[str, Any]:
        out = {k: int(pp_config[k]) for k in ("sampling_rate", "n_fft", "hop_length") if k in pp_config}
        sr, hop = out.get("sampling_rate", 16000), out.get("hop_length", 160)
        if "chunk_length" in pp_config:  # what the extractor's __init__ derives nb_max_frames from
            out["max_frames"] = int(pp_config["chunk_length"]) * sr // hop
        elif "nb_max_frames" in pp_config:
            out["max_frames"] = int(pp_config["nb_max_frames"])
        return out

    @classmethod
    def pretrained_projector(cls, path: str) -> Optional[PretrainedProjector]:
        """The tower's ``proj`` (one Linear with bias; ``LinearProjector``); ``hidden``,
        ``activation`` and ``norm`` do not apply to it."""
        from omni.models.hf_checkpoint import CheckpointReader, read_hf_config

        hf = read_hf_config(path)
        audio = cls.audio_config_of(hf)
        reader = CheckpointReader(path)
        prefix = next((p for p in cls.hf_weight_prefixes if p + "proj.weight" in reader), None)
        if prefix is None:
            return None
        d = int(audio.get("d_model", QwenOmniAudioConfig.d_model))
        return PretrainedProjector(out_dim=int(audio.get("output_dim", 3584)), hidden=d,
                                   names={"weight": prefix + "proj.weight", "bias": prefix + "proj.bias"})

    def new_projector(self, llm_width: int, **kwargs: Any) -> nn.Module:
        """The family's projector, one Linear (``kwargs``, a slot's MLP shape, do not apply), so
        that a tower trained from scratch has the checkpoint's shape too."""
        return LinearProjector(self.output_dim, llm_width)
