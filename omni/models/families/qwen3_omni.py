"""Qwen3-Omni's thinker: Qwen3-VL's vision tower (``qwen3_omni_vision``, its mergers and DeepStack
as the projector) and Qwen3-Omni's audio tower (``qwen3_omni_audio``) in two encoder slots, into a
Qwen3-MoE with interleaved M-RoPE whose first layers add the DeepStack features.

Loaded from a thinker-only directory (``qwen3_omni_moe_thinker``: what transformers writes for
``Qwen3OmniMoeThinkerForConditionalGeneration``) or a whole one in the released layout
(``qwen3_omni_moe``: the same tensors under ``thinker.``, beside the talker's and the code-to-wave
vocoder's, which are not loaded). Images take Qwen3-VL's positions, an audio clip's tokens count
up like text. ``export_qwen3_omni`` writes the released layout: the whole class with the thinker
alone (no talker), every tensor under ``thinker.``.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from dataloading.formats.tokenizer import PlaceholderTokens
from omni.models.families._hf_export import language_model, split_ids, write_checkpoint
from omni.models.families._omni import thinker_family, towers_or_refuse
from omni.models.families.family import Family
from omni.models.multimodal import OmniModel

# How the thinker's vocabulary frames each item (Qwen3OmniMoeProcessor's tokens, the Qwen3 vocabulary's)
TOKENS = {"image": PlaceholderTokens("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"),
          "video": PlaceholderTokens("<|video_pad|>", "<|vision_start|>", "<|vision_end|>"),
          "audio": PlaceholderTokens("<|audio_pad|>", "<|audio_start|>", "<|audio_end|>")}
# The thinker config's token fields besides the image and audio placeholders (the tokenizer's own)
_IDS = {"video_token_id": TOKENS["video"].token, "vision_start_token_id": TOKENS["image"].before,
        "audio_start_token_id": TOKENS["audio"].before}


def _towers(model: OmniModel):
    from omni.models.encoders.qwen3_omni_audio import Qwen3OmniAudioEncoder
    from omni.models.encoders.qwen3_omni_vision import Qwen3OmniVisionEncoder

    encoders = dict(model.encoders.items())
    if set(encoders) == {"image", "audio"} and isinstance(encoders["image"], Qwen3OmniVisionEncoder) \
            and isinstance(encoders["audio"], Qwen3OmniAudioEncoder):
        return encoders["image"], encoders["audio"]
    return None


def export_qwen3_omni(model: OmniModel, path: str, image_token_id: int, audio_token_id: int,
                      max_shard_bytes: Optional[int] = None, token_ids: Optional[Mapping[str, Any]] = None) -> None:
    """Write ``model`` (host tensors) to ``path`` as the released Qwen3-Omni checkpoints are laid
    out: ``Qwen3OmniMoeForConditionalGeneration`` with the thinker alone (``enable_audio_output``
    false), every tensor under ``thinker.``, the experts one tensor per expert. Refused, naming the
    part, for a model that is not a Qwen3-Omni thinker."""
    import transformers

    vision, audio = towers_or_refuse(_towers(model), "Qwen3-Omni", "qwen3_omni_vision", "qwen3_omni_audio")
    llm = model.llm.config
    if llm.family != "qwen3_moe" or llm.mrope_section is None or not llm.mrope_interleaved or not llm.norm_topk_prob:
        raise ValueError(f"a Qwen3-Omni thinker's language model is a Qwen3-MoE with interleaved M-RoPE and a router "
                         f"that renormalises its top-k weights; this backbone is family={llm.family!r} with "
                         f"mrope_section={llm.mrope_section}, mrope_interleaved={llm.mrope_interleaved}")
    top, text_ids = split_ids(token_ids or {})
    text = {**llm.to_hf(text_of_vlm=True), **text_ids, "model_type": "qwen3_omni_moe_text"}
    text["rope_parameters"]["interleaved"] = True  # the name Qwen3-Omni's config class reads
    thinker = {"text_config": text, "vision_config": vision.hf_vision_config(llm.hidden_size),
               "audio_config": audio.hf_audio_config(llm.hidden_size),
               "image_token_id": int(image_token_id), "audio_token_id": int(audio_token_id),
               "position_id_per_seconds": vision.config.tokens_per_second,
               "tie_word_embeddings": llm.tie_word_embeddings, **top}
    config = transformers.Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False)
    sd = {"thinker.visual." + vision.hf_name(k): vision.to_hf_tensor(k, t) for k, t in vision.state_dict().items()}
    names = vision.merger_names(len(vision.config.deepstack_visual_indexes), "thinker.visual.")
    sd.update({names[k]: t for k, t in model.projectors["image"].state_dict().items()})
    sd.update({"thinker.audio_tower." + k: t for k, t in audio.state_dict().items()})
    proj = {"fc1": "proj1", "fc2": "proj2"}
    sd.update({"thinker.audio_tower." + proj[k.split(".")[0]] + "." + k.split(".", 1)[1]: t
               for k, t in model.projectors["audio"].state_dict().items()})
    sd.update(language_model(model, "thinker.model.", "thinker.lm_head.weight"))
    write_checkpoint(config, "Qwen3OmniMoeForConditionalGeneration", sd, path, max_shard_bytes)


_FAMILY = thinker_family("qwen3_omni_vision", "qwen3_omni_audio", TOKENS, _IDS, "Qwen3-Omni", export_qwen3_omni,
                         "Qwen3OmniMoeProcessor", _towers)
FAMILIES: dict[str, Family] = {"qwen3_omni_moe_thinker": _FAMILY, "qwen3_omni_moe": _FAMILY}
