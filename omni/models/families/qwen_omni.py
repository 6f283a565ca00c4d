"""Qwen2.5-Omni's thinker: two towers in one model, the vision tower (``qwen_omni_vision``,
Qwen2.5-VL's, with its patch merger) and the audio tower (``qwen_omni_audio``, Whisper-like over
chunks, its pooled rows mapped by a linear projector), into a Qwen2 with M-RoPE.

Loaded from a thinker-only directory (``qwen2_5_omni_thinker``: what transformers writes for
``Qwen2_5OmniThinkerForConditionalGeneration``, tensors named ``visual.``, ``audio_tower.``,
``model.``, ``lm_head.``) or a whole one in the released checkpoints' layout (``qwen2_5_omni``:
the same under ``thinker.``, beside the talker's and the vocoder's, which are not loaded: speech
output is out of scope). Positions are the thinker's TMRoPE: an image's placeholders take
Qwen2-VL's (t, h, w) positions, an audio clip's count up like text
(``dataloading.construct.positions``).
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from dataloading.formats.tokenizer import PlaceholderTokens
from omni.models.families._hf_export import language_model, split_ids, write_checkpoint
from omni.models.families._omni import thinker_family, towers_or_refuse
from omni.models.families.family import Family
from omni.models.multimodal import OmniModel

# How the thinker's vocabulary frames each item (Qwen2_5OmniProcessor's tokens)
TOKENS = {"image": PlaceholderTokens("<|IMAGE|>", "<|vision_bos|>", "<|vision_eos|>"),
          "video": PlaceholderTokens("<|VIDEO|>", "<|vision_bos|>", "<|vision_eos|>"),
          "audio": PlaceholderTokens("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")}
# The thinker config's token fields besides the image and audio placeholders (the tokenizer's own)
_IDS = {"video_token_index": TOKENS["video"].token, "vision_start_token_id": TOKENS["image"].before,
        "vision_end_token_id": TOKENS["image"].after, "audio_start_token_id": TOKENS["audio"].before,
        "audio_end_token_id": TOKENS["audio"].after}


def _towers(model: OmniModel):
    from omni.models.encoders.qwen_omni_audio import QwenOmniAudioEncoder
    from omni.models.encoders.qwen_omni_vision import QwenOmniVisionEncoder

    encoders = dict(model.encoders.items())
    vision, audio = encoders.get("image"), encoders.get("audio")
    if set(encoders) == {"image", "audio"} and isinstance(vision, QwenOmniVisionEncoder) \
            and isinstance(audio, QwenOmniAudioEncoder):
        return vision, audio
    return None


def export_qwen2_5_omni(model: OmniModel, path: str, image_token_id: int, audio_token_id: int,
                        max_shard_bytes: Optional[int] = None, token_ids: Optional[Mapping[str, Any]] = None) -> None:
    """Write ``model`` (host tensors) to ``path`` as the released Qwen2.5-Omni checkpoints are laid
    out: ``Qwen2_5OmniForConditionalGeneration`` with the thinker alone (``enable_audio_output``
    false: no talker, no vocoder), every tensor under ``thinker.``, the towers' q/k/v apart as
    transformers keeps them. Refused, naming the part, for a model that is not a thinker."""
    import torch
    import transformers

    from omni.models.encoders.qwen_vl import merger_names

    vision, audio = towers_or_refuse(_towers(model), "Qwen2.5-Omni", "qwen_omni_vision", "qwen_omni_audio")
    llm = model.llm.config
    if llm.family != "qwen2" or llm.mrope_section is None or llm.mrope_interleaved:
        raise ValueError(f"a Qwen2.5-Omni thinker's language model is a Qwen2 with M-RoPE (not interleaved); this "
                         f"backbone is family={llm.family!r} with mrope_section={llm.mrope_section}")
    top, text_ids = split_ids(token_ids or {})
    thinker = {"text_config": {**llm.to_hf(text_of_vlm=True), **text_ids, "model_type": "qwen2_5_omni_text"},
               "vision_config": vision.hf_vision_config(llm.hidden_size),
               "audio_config": audio.hf_audio_config(llm.hidden_size),
               "image_token_index": int(image_token_id), "audio_token_index": int(audio_token_id),
               "position_id_per_seconds": vision.config.tokens_per_second,
               "tie_word_embeddings": llm.tie_word_embeddings, **top}
    config = transformers.Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    sd = vision.hf_tensors("thinker.visual.")
    names = merger_names("qwen2_5_vl", "thinker.visual.")
    sd.update({names[k]: t for k, t in model.projectors["image"].state_dict().items()})
    sd.update({"thinker.audio_tower." + k: t for k, t in audio.state_dict().items()})
    # The table the thinker never reads, which transformers' class holds: the loaded one, or
    # zeros for a tower trained from scratch.
    sd.setdefault("thinker.audio_tower.audio_bos_eos_token.weight", torch.zeros(2, llm.hidden_size))
    sd.update({"thinker.audio_tower.proj." + k: t for k, t in model.projectors["audio"].state_dict().items()})
    sd.update(language_model(model, "thinker.model.", "thinker.lm_head.weight"))
    write_checkpoint(config, "Qwen2_5OmniForConditionalGeneration", sd, path, max_shard_bytes)
    # transformers' from_pretrained of the whole class reads the talker's speakers file: none here
    torch.save({}, os.path.join(path, "spk_dict.pt"))


_FAMILY = thinker_family("qwen_omni_vision", "qwen_omni_audio", TOKENS, _IDS, "Qwen2.5-Omni", export_qwen2_5_omni,
                         "Qwen2_5OmniProcessor", _towers)
FAMILIES: dict[str, Family] = {"qwen2_5_omni_thinker": _FAMILY, "qwen2_5_omni": _FAMILY}
