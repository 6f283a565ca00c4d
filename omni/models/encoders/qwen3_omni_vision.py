"""The vision tower of Qwen3-Omni's thinker (plugin ``qwen3_omni_vision``).

Its computation is Qwen3-VL's tower (``qwen3_vl``: learned positions interpolated to each grid
beside the 2-D rotary ones, the merger and the DeepStack mergers as its projector); what
differs is where a checkpoint keeps it:
- the settings nest in the thinker's config (``thinker_config.vision_config`` in a whole
  Qwen3-Omni directory, ``vision_config`` in a thinker-only one);
- the weights sit under ``thinker.visual.`` (the released checkpoints) or ``visual.`` (what
  transformers saves for the thinker alone), and the mergers keep the Qwen2-VL names:
  ``merger.ln_q`` / ``merger.mlp.0`` / ``merger.mlp.2``, the DeepStack ones as ``merger_list.i``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Dict, Tuple

from dataloading.formats.media import MediaItem
from omni.models.encoders.qwen3_vl import Qwen3VisionConfig, Qwen3VisionEncoder
from omni.models.encoders.qwen_omni_vision import thinker_config
from omni.models.encoders.qwen_vl_processor import QwenVisionProcessor

OMNI3_MODEL_TYPES = ("qwen3_omni_moe", "qwen3_omni_moe_thinker")


class Qwen3OmniVisionProcessor(QwenVisionProcessor):
    """Qwen's image processor with Qwen3-VL's patch, budget and normalisation (the tower's
    config), and Qwen3-Omni's videos, not Qwen3-VL's timestamped ones: a clip is one item of ``t``
    temporal patches (sampled and resized as Qwen2-VL's, within Qwen3-Omni's clip budget of
    768 merge groups of 32 x 32 pixels) inside the family's ``<|vision_start|>`` and
    ``<|vision_end|>``, no timestamps; its temporal patches ``position_id_per_seconds x 2 / fps``
    rotary positions apart (transformers' ``video_second_per_grid`` is 2 frames / the fps
    asked for), text resuming past its largest position. transformers keeps those positions
    unfloored; Omni's are integers, so an ``fps`` that makes the step fractional is refused. Its
    own audio track interleaves token by token by time (``takes_track``, chunk 0)."""

    def __init__(self, config: Qwen3VisionConfig):
        super().__init__(config, resume_after_largest=True)
        self.track_chunk_positions = 0.0  # by time, token by token
        self.max_video_pixels = 768 * (self.patch * self.merge) ** 2  # Qwen3OmniMoeProcessor's videos_kwargs
        self.positions_per_second = float(config.tokens_per_second)  # the thinker's position_id_per_seconds
        self.patch_step()

    def patch_step(self) -> float:
        """Rotary positions between temporal patches: position_id_per_seconds x frames per patch / fps."""
        step = self.positions_per_second * self.frames / self.fps
        if not float(step).is_integer():
            raise ValueError(f"Qwen3-Omni spaces a video's temporal patches by position_id_per_seconds "
                             f"({self.positions_per_second:g}) x {self.frames} / fps ({self.fps:g}) = {step:g} "
                             f"positions, which Omni keeps whole; choose an fps that makes it a whole number")
        return step

    def with_options(self, **options) -> "Qwen3OmniVisionProcessor":
        other = super().with_options(**options)
        other.patch_step()
        return other

    def video(self, clip: Any) -> MediaItem:
        item = super().video(clip)
        return dataclasses.replace(item, rope_grid=(*item.rope_grid[:3], self.patch_step(), True))


class Qwen3OmniVisionEncoder(Qwen3VisionEncoder):
    """Qwen3-VL's vision tower, loaded from Qwen3-Omni checkpoints."""

    hf_model_types: ClassVar[Tuple[str, ...]] = OMNI3_MODEL_TYPES
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = ("thinker.visual.", "model.visual.", "visual.")

    @classmethod
    def processor(cls, config: Qwen3VisionConfig) -> Qwen3OmniVisionProcessor:
        return Qwen3OmniVisionProcessor(cls.build_config(config))

    @classmethod
    def vision_config_of(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        return dict(thinker_config(hf_config).get("vision_config") or {})

    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        params = super().params_from_hf_config(hf_config)
        thinker = thinker_config(hf_config)
        if "position_id_per_seconds" in thinker:  # the thinker's time step per second of video (kept for export)
            params["tokens_per_second"] = int(thinker["position_id_per_seconds"])
        return params

    @classmethod
    def merger_names(cls, layers: int, prefix: str) -> Dict[str, str]:
        """``DeepStackProjector``'s tensor names -> the thinker's (below ``prefix``): Qwen2-VL's
        merger names, the DeepStack ones as ``merger_list.i``."""
        parts = {"norm": "ln_q", "fc1": "mlp.0", "fc2": "mlp.2"}
        names = {}
        for kind in ("weight", "bias"):
            for ours, theirs in parts.items():
                names[f"merger.{ours}.{kind}"] = f"merger.{theirs}.{kind}"
                for i in range(layers):
                    names[f"deepstack.{i}.{ours}.{kind}"] = f"merger_list.{i}.{theirs}.{kind}"
        return {k: prefix + v for k, v in names.items()}
