"""The multimodal model: encoders + projectors + the LLM backbone.

Placeholder tokens in the packed text row are replaced by projected encoder outputs; the
loss is a *sum* over target tokens, and the trainer divides by the number of target tokens
in the whole global batch, so the result does not depend on how samples were split across
micro-batches or ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dataloading.batch import IGNORE_INDEX, MediaInputs, MicroBatch
from omni.models.encoders.base import EncoderAnchor
from omni.models.llm import Decoder
from omni.models.projector import Projector


@dataclass
class LossParts:
    ce_sum: torch.Tensor  # summed cross-entropy over target tokens (not normalised)
    num_targets: int
    aux_loss: torch.Tensor | None  # MoE router losses (already weighted by their coefficients)


class OmniModel(nn.Module):
    def __init__(
        self,
        llm: Decoder,
        encoders: dict[str, EncoderAnchor],
        projectors: dict[str, Projector],
        frozen: set[str] | None = None,
    ):
        """``encoders`` and ``projectors`` are keyed by modality ("image", "audio", ...)."""
        super().__init__()
        self.llm = llm
        self.encoders = nn.ModuleDict(encoders)
        self.projectors = nn.ModuleDict(projectors)
        for modality in frozen or ():
            self.encoders[modality].requires_grad_(False)

    @property
    def modalities(self) -> list[str]:
        return list(self.encoders.keys())

    def embed_media(self, modality: str, media: MediaInputs) -> torch.Tensor:
        feats = self.encoders[modality](media.features, media.sizes)
        return self.projectors[modality](feats)

    def embed(self, input_ids: torch.Tensor, media: dict[str, MediaInputs]) -> torch.Tensor:
        """Text embeddings of a flat row [T] with media embeddings written at their positions -> [T, H]."""
        embeds = self.llm.embed(input_ids)
        for modality, inputs in media.items():
            if modality not in self.encoders:
                raise KeyError(f"the batch has {modality} inputs but the model has no {modality} encoder")
            out = self.embed_media(modality, inputs).to(embeds.dtype)
            if inputs.output_rows is not None:  # a context-parallel rank keeps its placeholders' rows
                out = out[inputs.output_rows]
            if out.shape[0] != inputs.positions.numel():
                raise RuntimeError(
                    f"{modality} encoder produced {out.shape[0]} tokens for {inputs.positions.numel()} placeholders"
                )
            # Out-of-place so gradients flow to both the text embeddings and the encoder.
            embeds = embeds.index_copy(0, inputs.positions, out)
        return embeds

    def forward(self, mb: MicroBatch) -> LossParts:
        embeds = self.embed(mb.input_ids, mb.media)
        out = self.llm(inputs_embeds=embeds[None], position_ids=mb.position_ids[None], output_hidden=True)
        hidden = out.hidden_states[0]
        target_mask = mb.labels != IGNORE_INDEX
        # Logits only where there is a target: the vocab projection is the costliest matmul of a
        # small model and most packed positions (prompts, media) carry no loss.
        logits = self.llm.lm_logits(hidden[target_mask]).float()
        ce_sum = F.cross_entropy(logits, mb.labels[target_mask], reduction="sum")
        return LossParts(ce_sum=ce_sum, num_targets=int(target_mask.sum()), aux_loss=out.aux_loss)
