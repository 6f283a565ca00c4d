"""The native decoder: embeddings -> N pre-norm blocks -> final norm -> LM head.

Input is packed: a row may hold several documents, each starting where ``position_ids == 0``.
Attention never crosses a document (``segment_attention``) and RoPE uses ``position_ids``, so a
packed row computes exactly what running each document alone would. For generation, a
``KVCache`` passed to ``forward`` keeps the earlier tokens' keys and values (``kv_cache.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import segment_ids_from_position_ids
from .config import DecoderConfig
from .kv_cache import KVCache
from .layers import DecoderBlock, RMSNorm, attach_aux_loss, run_block
from .moe import Experts, Router
from .rope import RotaryEmbedding


@dataclass
class DecoderOutput:
    logits: Optional[torch.Tensor] = None  # [B, T, V], None when output_hidden=True
    hidden_states: Optional[torch.Tensor] = None  # final-normed [B, T, H] when output_hidden=True
    aux_loss: Optional[torch.Tensor] = None  # summed MoE router losses (coefficients applied); None if dense


def as_decoder_config(config: Any) -> DecoderConfig:
    """Accept the dataclass, a plain dict, or a Hydra/OmegaConf node of it."""
    if isinstance(config, DecoderConfig):
        return config
    if isinstance(config, dict):
        return DecoderConfig(**config)
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        DictConfig = None
    if DictConfig is not None and isinstance(config, DictConfig):
        obj = OmegaConf.to_object(config)
        return obj if isinstance(obj, DecoderConfig) else DecoderConfig(**obj)
    raise TypeError(f"expected a DecoderConfig, got {type(config).__name__}")


class LayerDict(nn.ModuleDict):
    """The blocks keyed by their global index. A pipeline stage deletes the blocks it does not
    run and the rest keep their names (``layers.7...``), so checkpoints are layout-free.
    Indexing by int and iterating over blocks work as for a ModuleList."""

    def __getitem__(self, idx):
        return super().__getitem__(str(idx))

    def __iter__(self):
        return iter(self.values())


class Decoder(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        config = as_decoder_config(config)
        config.validate()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = LayerDict({str(i): DecoderBlock(config, i) for i in range(config.num_layers)})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied: no separate head, ``lm_logits`` reads the embedding matrix.
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """normal(0, initializer_range) for every matrix, zeros for biases, ones for norms.
        Visits modules in registration order, so the result depends only on the torch seed."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, Router):
                m.weight.normal_(0.0, std)
            elif isinstance(m, Experts):
                m.w_gate_up.normal_(0.0, std)
                m.w_down.normal_(0.0, std)
        self.rotary.reset_parameters()

    def init_rule(self, owner: nn.Module, path: str, attr: str):
        """How ``owner.attr`` starts when the model is materialised from a seed
        (``omni.models.materialize``): the same distributions as ``init_weights``."""
        from ..materialize import Computed, Fill, Normal
        from .rope import rope_parameters

        std = self.config.initializer_range
        if isinstance(owner, nn.Linear):
            return Normal(std) if attr == "weight" else Fill(0.0)
        if isinstance(owner, (nn.Embedding, Router, Experts)):
            return Normal(std)
        if isinstance(owner, RMSNorm):
            return Fill(1.0)
        if isinstance(owner, RotaryEmbedding) and attr == "inv_freq":
            return Computed(lambda: rope_parameters(self.config, device=torch.device("cpu"))[0])
        return None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        output_hidden: bool = False,
        rope_position_ids: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
    ) -> DecoderOutput:
        """input_ids [B, T] (or [T], treated as B=1) or inputs_embeds [B, T, H] (or [B, T, H x (1 + k)]:
        the embeddings, then k DeepStack residuals, ``run_layers``); position_ids [B, T]
        or [T] (default: 0..T-1, one document per row): where documents start (at 0) and, without
        ``rope_position_ids``, the rotary positions. ``rope_position_ids`` [3, B, T] or [3, T]:
        M-RoPE positions (temporal, height, width; ``model.mrope_section``).

        ``cache`` (generation only): the T tokens of each row follow the row's cached ones and
        attend to them; their keys join the cache (every row advances by T). ``position_ids`` are
        then only the rotary positions (default: each row's cached length onwards)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Decoder.forward needs exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            h = self.embed(input_ids[None] if input_ids.dim() == 1 else input_ids)
        else:
            h = inputs_embeds[None] if inputs_embeds.dim() == 2 else inputs_embeds
        b, t = h.shape[:2]
        if cache is not None:
            return self._forward_cached(h, position_ids, rope_position_ids, cache, output_hidden)
        if position_ids is None:
            # One document per row: plain causal attention, no mask needed.
            position_ids = torch.arange(t, device=h.device).expand(b, t)
            segment_ids = None
        else:
            position_ids = position_ids[None] if position_ids.dim() == 1 else position_ids
            position_ids = position_ids.expand(b, t)
            segment_ids = segment_ids_from_position_ids(position_ids)
        if rope_position_ids is not None:
            rope_position_ids = rope_position_ids[:, None] if rope_position_ids.dim() == 2 else rope_position_ids
            rope_position_ids = rope_position_ids.expand(3, b, t)
        rotary = rope_position_ids if rope_position_ids is not None else position_ids
        h, aux_loss = self.run_layers(h, self.rotary(rotary, h.dtype), segment_ids)
        h = self.norm(h)
        if output_hidden:
            return DecoderOutput(logits=None, hidden_states=h, aux_loss=aux_loss)
        return DecoderOutput(logits=self.lm_logits(h), hidden_states=None, aux_loss=aux_loss)

    def _forward_cached(self, h: torch.Tensor, position_ids: Optional[torch.Tensor],
                        rope_position_ids: Optional[torch.Tensor], cache: KVCache,
                        output_hidden: bool) -> DecoderOutput:
        """``forward`` through a KV cache. Its own loop rather than ``run_layers``: each layer
        gets its view of the cache, and nothing of training (activation recompute, router
        losses carried to the loss) applies."""
        b, t = h.shape[:2]
        if position_ids is None:
            position_ids = cache.next_positions(t)
        position_ids = (position_ids[None] if position_ids.dim() == 1 else position_ids).expand(b, t)
        if rope_position_ids is not None:
            rope_position_ids = rope_position_ids[:, None] if rope_position_ids.dim() == 2 else rope_position_ids
            rope_position_ids = rope_position_ids.expand(3, b, t)
        h, deepstack = self.split_deepstack(h)
        cos_sin = self.rotary(rope_position_ids if rope_position_ids is not None else position_ids, h.dtype)
        step = cache.step(t)
        aux_loss = None
        for layer in self.layers:
            h, aux = layer(h, cos_sin, step.layer(layer.layer_idx))
            h = self._add_deepstack(h, deepstack, layer.layer_idx)
            if aux is not None:
                aux_loss = aux if aux_loss is None else aux_loss + aux
        cache.advance(t)
        h = self.norm(h)
        if output_hidden:
            return DecoderOutput(logits=None, hidden_states=h, aux_loss=aux_loss)
        return DecoderOutput(logits=self.lm_logits(h), hidden_states=None, aux_loss=aux_loss)

    def run_layers(self, h: torch.Tensor, cos_sin, segments, token_mask: Optional[torch.Tensor] = None,
                   aux_weight: Optional[float] = None, checkpoint: str = "none", offload=None):
        """The blocks this module holds (all of them, or one pipeline stage's), in order.

        ``segments``: segment ids [B, T], None (one document per row), or a context-parallel
        description (see ``Attention``). ``token_mask`` [B, T] marks real tokens (padding is left out
        of the MoE router statistics). With ``aux_weight`` set, MoE router losses are not returned
        for the caller to add: their gradient (times ``aux_weight``) is attached to the hidden
        state, so it flows whatever pipeline stage the layer sits on; the returned aux value is
        then detached, for logging. ``checkpoint``: none | selective | full activation recompute.
        ``offload``: a ``parallel.activation_offload.ActivationOffload`` for the blocks it names.
        ``h`` may carry DeepStack residuals (``split_deepstack``): layer i < k adds the i-th.
        Returns (hidden, summed aux loss or None)."""
        h, deepstack = self.split_deepstack(h)
        aux_loss = None
        for layer in self.layers:
            if offload is not None and offload.applies(layer.layer_idx):
                with offload.block(layer.layer_idx):
                    h, aux = run_block(layer, h, cos_sin, segments, token_mask, checkpoint)
            else:
                h, aux = run_block(layer, h, cos_sin, segments, token_mask, checkpoint)
            h = self._add_deepstack(h, deepstack, layer.layer_idx)
            if aux is None:
                continue
            if aux_weight is not None:
                h = attach_aux_loss(h, aux, aux_weight)
                aux = aux.detach() * aux_weight
            aux_loss = aux if aux_loss is None else aux_loss + aux
        return h, aux_loss

    def split_deepstack(self, h: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``h`` [..., H] as it is, or [..., H x (1 + k)] split into the hidden state and k
        DeepStack residuals (Qwen3-VL: the vision tower's intermediate features at the media
        positions, zero elsewhere), which layers 0..k-1 add to their outputs. The layers that
        add them must all run here: a pipeline stage boundary among them is refused when the
        stages are cut (``OmniModel.keep_stage``)."""
        width = self.config.hidden_size
        if h.shape[-1] == width:
            return h, None
        if h.shape[-1] % width:
            raise ValueError(f"hidden states of width {h.shape[-1]} are neither the model's {width} nor a multiple "
                             f"of it (the embeddings and DeepStack residuals)")
        return h[..., :width], h[..., width:]

    def _add_deepstack(self, h: torch.Tensor, deepstack: Optional[torch.Tensor], layer_idx: int) -> torch.Tensor:
        width = self.config.hidden_size
        if deepstack is None or layer_idx * width >= deepstack.shape[-1]:
            return h
        return h + deepstack[..., layer_idx * width:(layer_idx + 1) * width].to(h.dtype)

    def num_active_params(self) -> int:
        """Parameters one token multiplies through (the embedding lookup is free, the LM head is
        not; a MoE layer counts only its top-k experts)."""
        return self.config.hidden_size * self.config.vocab_size + sum(self.active_params_per_layer())

    def active_params_per_layer(self) -> list[int]:
        """Of ``num_active_params``, each decoder layer's share."""
        c = self.config
        h, d = c.hidden_size, c.resolved_head_dim()
        attn = h * c.num_heads * d * 2 + h * c.num_kv_heads * d * 2
        out = []
        for i in range(c.num_layers):
            n = attn
            if c.is_moe_layer(i):
                n += h * c.num_experts + c.num_experts_per_tok * 3 * h * c.expert_intermediate_size()
                if c.shared_expert_intermediate_size:
                    n += 3 * h * c.shared_expert_intermediate_size + h
            else:
                n += 3 * h * c.intermediate_size
            out.append(n)
        return out

    def num_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token for MFU: 6 * active params (forward 2, backward 4) plus the
        attention score/value matmuls, 12 * layers * heads * head_dim * seq_len (PaLM's
        convention, not halved for causality, so MFU compares with other frameworks)."""
        c = self.config
        attn = 12 * c.num_layers * c.num_heads * c.resolved_head_dim() * seq_len
        return float(6 * self.num_active_params() + attn)
