"""The multimodal model: encoders + projectors + the LLM backbone.

Placeholder tokens in the packed text row are replaced by projected encoder outputs; the
loss is a *sum* over target tokens, and the trainer divides by the number of target tokens
in the whole global batch, so the result does not depend on how samples were split across
micro-batches or ranks.

The same module serves every layout. ``forward`` takes token ids (logits, as any module), a
whole micro-batch (returns ``LossParts``) or, as a pipeline stage, the previous stage's hidden
state with the micro-batch it belongs to (every step runs as a pipeline, one stage without
pipeline parallelism: ``parallel.pipeline_executor``). A pipeline stage is this model with the parts of other stages
deleted (``keep_stage``); parameter names never change, so checkpoints move between layouts.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch
from torch import nn

from dataloading.construct.batch import IGNORE_INDEX, CPInfo, MediaInputs, MicroBatch
from dataloading.construct.context_parallel import local_documents, local_positions, local_real_tokens
from omni.models.attention import (ContextParallelSegments, PackedSegments, segment_ids_from_position_ids,
                                   uses_varlen_kernels)
from omni.models.device_inputs import on_the_device
from omni.models.encoders.base import EncoderAnchor
from omni.models.llm import Decoder
from omni.models.projector import Projector
from parallel.cp_attention import plan_ring_hops, plan_ulysses
from parallel.strict_device import on_device
from parallel.linear_cross_entropy import fused_linear_cross_entropy, linear_cross_entropy
from parallel.tensor_parallel import gather_sequence_shards, local_tensor, scatter_to_sequence_shards, vocab_range


class LossParts(NamedTuple):
    # A NamedTuple (a pytree), so FSDP's forward hooks see the tensors inside.
    ce_sum: torch.Tensor  # summed cross-entropy over target tokens (not normalised)
    num_targets: int
    aux_loss: Optional[torch.Tensor]  # MoE router losses (already weighted by their coefficients)


@dataclass
class ParallelRuntime:
    """What the forward pass needs to know about the layout (set by ``omni.runtime.parallelize``;
    the defaults are one process)."""

    tp_mesh: object = None  # DeviceMesh of the TP group, None without TP
    tp_group: object = None
    tp_rank: int = 0
    tp_size: int = 1
    cp_group: object = None
    cp_size: int = 1
    cp_impl: str = "ring"
    checkpoint: str = "none"  # activation checkpointing: none | selective | full
    offload: object = None  # parallel.activation_offload.ActivationOffload (parallel.activation_offload)
    fused_loss: bool = False  # the head and loss through liger-kernel (DeviceRules.fused_loss)
    attn_backend: str = "auto"  # model.attn_backend (omni.kernels.varlen_attention)
    # Each micro-batch's router loss is weighted by this (1 / micro-batches in the global batch)
    # and its gradient attached where it is computed; None keeps the single-process contract of
    # returning aux_loss for the caller to add.
    aux_weight: Optional[float] = None
    first_stage: bool = True
    last_stage: bool = True


@dataclass
class Prepared:
    """One micro-batch, ready for any stage: the batch plus what attention and the loss need."""

    mb: MicroBatch
    position_ids: torch.Tensor  # [1, T]
    segments: object  # segment ids [1, T], None, or ContextParallelSegments
    token_mask: Optional[torch.Tensor]  # [1, T] bool, None when every token is real
    global_targets: float = 1.0  # the loss of this micro-batch is ce_sum / global_targets
    index: int = 0  # the micro-batch's place in the step (its encoder chunk under multiplexing)
    # Built on the host from the host labels (None when the row came to ``prepare`` already on
    # the device): the target positions and their labels, so the loss gathers by index instead
    # of selecting by a device mask (a boolean selection reads its size back from the device).
    target_index: Optional[torch.Tensor] = None  # int64 [n_targets]
    target_labels: Optional[torch.Tensor] = None  # int64 [n_targets]
    num_targets: Optional[int] = None
    rope_position_ids: Optional[torch.Tensor] = None  # [3, 1, T]: M-RoPE positions (None: position_ids)


class StageLog:
    """What a step's pipeline stages report besides their outputs, for logging: the detached
    0-dim CE sums (last stage) and router losses of its micro-batches, in the order they ran.
    The trainer sums them on the device and reads the step's total once.

    A plain class, not a dataclass: FSDP2 casts a module's inputs by rebuilding every dataclass
    and list among them, which would hand the stage a copy to append to."""

    def __init__(self) -> None:
        self.ce_sums: list[torch.Tensor] = []
        self.aux_sums: list[torch.Tensor] = []


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
        # Qwen3-VL's DeepStack: its projector's rows carry, beside the embedding, residuals for
        # the first LLM layers (``Decoder.split_deepstack``); the model's input rows are that wide.
        self.deepstack_layers = max((int(getattr(p, "deepstack_layers", 0)) for p in projectors.values()), default=0)
        self.runtime = ParallelRuntime()
        # Set by omni.runtime.parallelize on the first stage's chunk: the media embeddings then
        # come from the multiplexing runtime (which holds the encoders) instead of inline ones.
        self.multiplexer = None
        self.timeline = None  # omni.runtime.timeline.Timeline, when the step is being timed

    @property
    def modalities(self) -> list[str]:
        return list(self.encoders.keys())

    @property
    def input_width(self) -> int:
        """The width of the rows the first layer takes (and the media rows written into them):
        the LLM's, times 1 + the DeepStack layers."""
        return self.llm.config.hidden_size * (1 + self.deepstack_layers)

    def _widen(self, embeds: torch.Tensor) -> torch.Tensor:
        """Text embeddings [..., H] as ``input_width`` rows (zero DeepStack residuals)."""
        if not self.deepstack_layers:
            return embeds
        return torch.cat([embeds, embeds.new_zeros(*embeds.shape[:-1], self.input_width - embeds.shape[-1])], dim=-1)

    def set_attn_backend(self, backend: str) -> None:
        """``model.attn_backend`` for the backbone and every encoder."""
        self.runtime.attn_backend = backend
        for enc in self.encoders.values():
            enc.attn_backend = backend

    # -- pipeline stages --------------------------------------------------------------------
    def keep_stage(self, layer_ids: list[int], first: bool, last: bool) -> None:
        """Delete everything stage (``layer_ids``, first?, last?) does not run. The last stage of
        a tied model keeps the embedding as its LM head (a copy whose gradient is summed with the
        first stage's). Encoders, if still here, stay with the first stage (under multiplexing
        they have left the model for the runtime's ``MediaTower`` already)."""
        k = self.deepstack_layers
        if k and (first and not set(range(k)) <= set(layer_ids) or not first and min(layer_ids) < k):
            raise ValueError(f"the first pipeline stage must hold the LLM's first {k} layers, which add the vision "
                             f"tower's DeepStack features; this split gives it layers {sorted(layer_ids)}: "
                             f"use fewer stages or parallel.pp_layers that give stage 0 at least {k}")
        for i in [int(k) for k in self.llm.layers.keys()]:
            if i not in layer_ids:
                del self.llm.layers[str(i)]
        if not first:
            self.encoders = nn.ModuleDict()
            self.projectors = nn.ModuleDict()
        if not first and not (last and self.llm.lm_head is None):
            self.llm.embed_tokens = None
        if not last:
            self.llm.norm = None
            self.llm.lm_head = None
        self.runtime.first_stage, self.runtime.last_stage = first, last

    # -- inputs -------------------------------------------------------------------------------
    def prepare(self, mb: MicroBatch, global_targets: float = 1.0, real_tokens: int | None = None,
                max_seqlen: int | None = None, device: torch.device | str | None = None) -> Prepared:
        """Positions, attention segments and the real-token mask of a (possibly CP-sliced or
        padded) micro-batch. ``real_tokens``: the row's first tokens that are not step padding.
        ``max_seqlen``: its longest document, known on the host (read from ``mb.cu_seqlens``
        when not given) — the varlen attention kernels need it. ``device``: where the row
        trains; a host row is described on the host (target positions, CP ring hops) and moved
        there once with what was derived from it, so the forward reads nothing back."""
        on_host = not on_device(mb.input_ids)
        device = mb.input_ids.device if device is None else torch.device(device)
        p = self._describe(mb, global_targets, real_tokens, max_seqlen, on_host, device)
        if on_host:
            targets = (mb.labels != IGNORE_INDEX).nonzero().squeeze(1)
            p.target_index, p.target_labels, p.num_targets = targets, mb.labels[targets], int(targets.numel())
            p = on_the_device(p, device)
        return p

    def _describe(self, mb: MicroBatch, global_targets: float, real_tokens: int | None, max_seqlen: int | None,
                  on_host: bool, device: torch.device) -> Prepared:
        rt = self.runtime
        position_ids = mb.position_ids[None]
        t = mb.input_ids.numel()
        mask = None
        if mb.cp is not None and mb.cp.cp_size > 1:
            doc = local_documents(mb.cp, t)
            backend = rt.attn_backend if uses_varlen_kernels(rt.attn_backend, device) else "sdpa"
            segments = ContextParallelSegments(doc[None], position_ids, rt.cp_group, rt.cp_impl, backend=backend)
            if on_host:
                segments = _plan_cp_attention(segments, mb.cp, mb.position_ids)
            mask = local_real_tokens(mb.cp, t)[None]
        else:
            segments = segment_ids_from_position_ids(position_ids)
            varlen = uses_varlen_kernels(rt.attn_backend, device)
            if varlen or on_host:
                # The documents' lengths from the host row: the varlen kernels take them, and the
                # PyTorch path then reads nothing back from the device either.
                lengths = tuple((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()) if on_host else None
                if max_seqlen is None:
                    max_seqlen = (max(lengths, default=0) if lengths is not None else
                                  int((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).max()) if t else 0)
                segments = PackedSegments(segments, mb.cu_seqlens.to(torch.int32), max_seqlen, True,
                                          rt.attn_backend if varlen else "sdpa", lengths)
            if real_tokens is not None and real_tokens < t:
                mask = (torch.arange(t, device=mb.input_ids.device) < real_tokens)[None]
        # M-RoPE positions when the backbone rotates by them and an item of the row has a grid;
        # else the 1-D positions (equal in every row for text, so the same rotation).
        rope = mb.rope_position_ids[:, None] if (self.llm.config.mrope_section is not None
                                                and mb.rope_position_ids is not None) else None
        return Prepared(mb, position_ids, segments, mask, global_targets, rope_position_ids=rope)

    def embed_media(self, modality: str, media: MediaInputs) -> torch.Tensor:
        feats = self.encoders[modality](media.features, media.sizes)
        return self.projectors[modality](feats, media.sizes)

    def embed(self, input_ids: torch.Tensor, media: dict[str, MediaInputs]) -> torch.Tensor:
        """Text embeddings of a flat row [T] with media embeddings written at their positions -> [T, H]
        ([T, ``input_width``] with DeepStack residuals, zero at the text's positions)."""
        embeds = self._widen(self.llm.embed(input_ids))
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
            if out.shape[1] < embeds.shape[1]:  # a projector without DeepStack beside one with it
                out = torch.nn.functional.pad(out, (0, embeds.shape[1] - out.shape[1]))
            # Out-of-place so gradients flow to both the text embeddings and the encoder.
            embeds = embeds.index_copy(0, inputs.positions, out)
        return embeds

    # -- forward --------------------------------------------------------------------------------
    def forward(self, x, prepared: Optional[Prepared] = None, log: Optional[StageLog] = None, *,
                media: Optional[dict[str, MediaInputs]] = None, position_ids: Optional[torch.Tensor] = None,
                rope_position_ids: Optional[torch.Tensor] = None):
        """Every input comes as an argument, in one of three ways:

        - token ids, [T] or [B, T] (integers): the logits [B, T, vocab], as any module is called
          (``model(input_ids)`` on a loaded model). ``media``: each modality's inputs for a single
          row, written at its placeholders; ``position_ids`` / ``rope_position_ids`` as
          ``Decoder.forward`` takes them (default: one document per row).
        - a ``MicroBatch`` or ``Prepared`` (a training row through the whole model): ``LossParts``.
        - a pipeline stage's input activation (a placeholder on the first stage) with the
          micro-batch it belongs to (``prepared``): the next stage's input, or on the last stage
          the micro-batch's loss divided by its global target count; ``log`` collects the
          detached CE and router sums."""
        if prepared is not None:
            return self._stage_forward(x, prepared, log)
        if isinstance(x, MicroBatch):
            x = self.prepare(x)
        if isinstance(x, Prepared):
            h, aux = self._body(self._input_hidden(x), x)
            ce = self._ce_sum(h, x)
            # The count from the host when prepare saw the host row; a row already on the device
            # (evaluation, tests) pays a read for it.
            n = x.num_targets if x.num_targets is not None else int((x.mb.labels != IGNORE_INDEX).sum())
            return LossParts(ce_sum=ce, num_targets=n, aux_loss=aux)
        if isinstance(x, torch.Tensor) and not x.is_floating_point():
            return self.logits(x, media, position_ids, rope_position_ids)
        raise TypeError(f"OmniModel takes token ids, a MicroBatch or a Prepared row, or a pipeline stage's "
                        f"activation with its Prepared micro-batch; got {type(x).__name__}"
                        + (f" of {x.dtype} without the micro-batch" if isinstance(x, torch.Tensor) else ""))

    def logits(self, input_ids: torch.Tensor, media: Optional[dict[str, MediaInputs]] = None,
               position_ids: Optional[torch.Tensor] = None,
               rope_position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Next-token logits [B, T, vocab] of token rows [T] or [B, T], media written at their
        placeholders (one row only: a media item's positions index a flat row)."""
        if self.runtime.tp_mesh is not None or not (self.runtime.first_stage and self.runtime.last_stage):
            raise RuntimeError("logits need the whole model in one process; gather a split one first "
                               "(omni export, or ParallelModel.inline_encoders for one process)")
        rows = input_ids[None] if input_ids.dim() == 1 else input_ids
        if media:
            if rows.shape[0] != 1:
                raise ValueError(f"media go with one row of token ids, not {rows.shape[0]}")
            embeds = self.embed(rows[0], media)[None]
        else:
            embeds = self.llm.embed(rows)
        return self.llm(inputs_embeds=embeds, position_ids=position_ids, rope_position_ids=rope_position_ids).logits

    def _stage_forward(self, x: torch.Tensor, p: Prepared, log: Optional[StageLog]):
        h = self._input_hidden(p) if self.runtime.first_stage else x
        h, aux = self._body(h, p)
        if aux is not None and log is not None:
            log.aux_sums.append(aux.detach())
        if not self.runtime.last_stage:
            return h
        ce = self._ce_sum(h, p)
        if log is not None:
            log.ce_sums.append(ce.detach())
        return ce / p.global_targets

    def _input_hidden(self, p: Prepared) -> torch.Tensor:
        h = self._multiplexed_hidden(p) if self.multiplexer is not None else self._inline_hidden(p)
        if torch.is_grad_enabled() and not h.requires_grad:
            # A frozen embedding and no trainable media rows in this micro-batch (model.freeze=
            # [llm] with the projector training, a text-only row): its backward must still run
            # through the layers, as on the ranks whose rows carry media (FSDP gathers the frozen
            # weights for it, the pipeline sends gradients back), so the collectives pair up.
            h = h.detach().requires_grad_()
        return h

    def _inline_hidden(self, p: Prepared) -> torch.Tensor:
        h = self.embed(p.mb.input_ids, p.mb.media)[None]
        idle = [m for m in self.encoders if m not in p.mb.media]
        if idle and torch.is_grad_enabled():
            h = h + self._zero_touch(idle)
        if self.runtime.tp_mesh is not None:  # sequence parallelism: each TP rank keeps 1/tp of the row
            h = scatter_to_sequence_shards(h, self.runtime.tp_mesh)
        return h

    def _multiplexed_hidden(self, p: Prepared) -> torch.Tensor:
        """Text embeddings with the media rows the multiplexing runtime delivered to this rank:
        under sequence parallelism only this TP shard's rows, written after the split."""
        h = self._widen(self.llm.embed(p.mb.input_ids))[None]
        if self.runtime.tp_mesh is not None:
            h = scatter_to_sequence_shards(h, self.runtime.tp_mesh)
        return self.multiplexer.write_embeddings(p.index, h[0])[None]

    def _zero_touch(self, modalities: list[str]) -> torch.Tensor:
        """0 x the trainable weights of encoders this micro-batch does not use: they get zero
        gradients instead of none, so every data-parallel rank reduces the same gradients (a
        rank without media would otherwise skip part of FSDP's reduce-scatter and hang the rest)."""
        params = [q for m in modalities for mod in (self.encoders[m], self.projectors[m])
                  for q in mod.parameters() if q.requires_grad]
        if not params:
            return 0.0
        return sum(q.reshape(-1)[:1].sum() for q in params) * 0.0

    def _body(self, h: torch.Tensor, p: Prepared):
        rt = self.runtime
        cos_sin = self.llm.rotary(p.position_ids if p.rope_position_ids is None else p.rope_position_ids, h.dtype)
        mask = p.token_mask
        if mask is not None and rt.tp_mesh is not None:
            mask = mask.chunk(rt.tp_size, dim=1)[rt.tp_rank]
        return self.llm.run_layers(h, cos_sin, p.segments, mask, rt.aux_weight, rt.checkpoint, rt.offload)

    def _ce_sum(self, h: torch.Tensor, p: Prepared) -> torch.Tensor:
        """Summed cross-entropy at the target positions. Logits only where there is a target:
        the vocab projection is the costliest matmul of a small model and most packed positions
        (prompts, media, padding) carry no loss. Under TP the logits stay split by vocabulary."""
        rt = self.runtime
        h = self.llm.norm(h)
        if rt.tp_mesh is not None:
            h = gather_sequence_shards(h, rt.tp_mesh, partial_grad=True)
        if p.target_index is not None:  # host-built: a gather, nothing read back
            hidden, labels = h[0].index_select(0, p.target_index), p.target_labels
        else:
            target_mask = p.mb.labels != IGNORE_INDEX
            hidden, labels = h[0][target_mask], p.mb.labels[target_mask]
        weight = self.llm.embed_tokens.weight if self.llm.lm_head is None else self.llm.lm_head.weight
        # The head and the loss in chunks of targets (parallel/linear_cross_entropy.py): never
        # [targets, vocab] logits at once, under TP each rank its vocabulary rows.
        if rt.tp_mesh is None:
            if rt.fused_loss:  # liger-kernel's fused kernel, on a GPU where it is installed
                return fused_linear_cross_entropy(hidden, weight, labels)
            return linear_cross_entropy(hidden, weight, labels)
        start, _ = vocab_range(self.llm.config.vocab_size, rt.tp_size, rt.tp_rank)
        return linear_cross_entropy(hidden, local_tensor(weight), labels, start, rt.tp_group)


def _plan_cp_attention(seg: ContextParallelSegments, info: CPInfo,
                       position_ids: torch.Tensor) -> ContextParallelSegments:
    """``seg`` with the CP attention planned on the host from the CP layout, which gives every
    peer's documents and positions without a message. Ring: which of this rank's queries and
    which keys of each visiting block (from CP rank ``cp_rank - s`` at hop s) are computed.
    Ulysses: the whole row's order into documents and those documents as a varlen pack. Left
    unplanned (the attention then finds it on the device, reading back) when the row's
    positions do not count from 0 in every document."""
    t = position_ids.numel()
    if not torch.equal(local_positions(info, t), position_ids):
        return seg
    peers = [replace(info, cp_rank=r) for r in range(info.cp_size)]
    docs = [local_documents(p, t) for p in peers]
    poss = [local_positions(p, t) for p in peers]
    me = info.cp_rank
    if seg.impl == "ring":
        visiting = [((me - s) % info.cp_size) for s in range(1, info.cp_size)]
        return replace(seg, hops=plan_ring_hops(docs[me][None], poss[me][None],
                                                [(docs[r][None], poss[r][None]) for r in visiting]))
    plan = plan_ulysses(torch.cat(docs)[None], torch.cat(poss)[None], causal=True)
    packed = PackedSegments.from_lengths(list(plan.lengths), None, True, seg.backend)  # moved with the row
    return replace(seg, ulysses=plan, packed=packed)
