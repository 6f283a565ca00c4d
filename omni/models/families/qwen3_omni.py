"""Qwen3-Omni's thinker: Qwen3-VL's vision tower (``qwen3_omni_vision``, its mergers and DeepStack
as the projector) and Qwen3-Omni's audio tower (``qwen3_omni_audio``) in two encoder slots, into a
Qwen3-MoE with interleaved M-RoPE whose first layers add the DeepStack features.

Loaded from a thinker-only directory (``qwen3_omni_moe_thinker``: what transformers writes for
``Qwen3OmniMoeThinkerForConditionalGeneration``) or a whole one in the released layout
(``qwen3_omni_moe``: the same tensors under ``thinker.``, beside the talker's and the code-to-wave
vocoder's, which are not loaded). Images take Qwen3-VL's positions, an audio clip's tokens count
up like text. Not written back yet (no exporter).
"""
from __future__ import annotations

from dataloading.formats.tokenizer import PlaceholderTokens
from omni.models.families.family import Family
from omni.models.multimodal import OmniModel

# How the thinker's vocabulary frames each item (Qwen3OmniMoeProcessor's tokens, the Qwen3 vocabulary's)
TOKENS = {"image": PlaceholderTokens("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"),
          "video": PlaceholderTokens("<|video_pad|>", "<|vision_start|>", "<|vision_end|>"),
          "audio": PlaceholderTokens("<|audio_pad|>", "<|audio_start|>", "<|audio_end|>")}


def _matches(model: OmniModel) -> bool:
    from omni.models.encoders.qwen3_omni_audio import Qwen3OmniAudioEncoder
    from omni.models.encoders.qwen3_omni_vision import Qwen3OmniVisionEncoder

    encoders = dict(model.encoders.items())
    return (set(encoders) == {"image", "audio"} and isinstance(encoders["image"], Qwen3OmniVisionEncoder)
            and isinstance(encoders["audio"], Qwen3OmniAudioEncoder))


_FAMILY = Family(vision="qwen3_omni_vision", audio="qwen3_omni_audio", family_tokens=TOKENS, matches=_matches)
FAMILIES: dict[str, Family] = {"qwen3_omni_moe_thinker": _FAMILY, "qwen3_omni_moe": _FAMILY}
