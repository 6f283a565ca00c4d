"""The encoders and projectors as a module of their own, outside the LLM's module tree.

Under multiplexing the encoders run at the pipeline's cuts, before and between the LLM
stage's forwards. Inside the LLM chunk that FSDP wraps as a root they could not be sharded:
FSDP2 would meet the encoder's forward first, take it for a root, and refuse the chunk's
later. ``parallelize`` therefore lifts them out of the model into a ``MediaTower``. Parameter
names stay the full model's ("encoders.image.…", "projectors.image.…"), so checkpoints move
between layouts and placements unchanged.

Weights are either replicated on every encoder rank (the caller sums their gradients) or
FSDP-sharded over the encoder ranks (``shard``): each encoder layer is a unit of its own, the
rest of the encoder one unit (gathered for the whole chunk call), each projector one unit.
Resharding follows the LLM's ``parallel.reshard_after_forward``: true, a unit is gathered for
each chunk's forward and again for its backward (least memory); false (the default under
pipeline parallelism, where several chunks are in flight), it is gathered once per step and
modality, its gradients are reduce-scattered once, in the step's last backward, and it is
released then (between steps the weights, and always the optimizer state, stay sharded).
FSDP's collectives span all encoder ranks, so every one of them calls ``encode`` for every
modality present anywhere in a chunk, with no items if it has none — the multiplexing
runtime guarantees it — and parameters a rank did not use get zero gradients in the
reduce-scatter instead of leaving it mismatched.

``hybrid`` is FSDP2's HSDP over a 2-D mesh (replicate, shard): the weights are sharded inside
each shard group (``multiplex.encoder_shard_group`` consecutive encoder ranks, default a node)
and replicated across the groups. Its gradients are reduce-scattered inside the group after
every chunk's backward (so between backwards a rank holds only its fp32 shard of them, never
the full-size gradient; ``parallel.fsdp_reduce_every_microbatch=false``: once per step, as
``sharded``), and all-reduced across the groups once, in the step's last backward: the
traffic that crosses groups (the network) stays one shard-sized all-reduce per step. Every
rank of every group takes the same decisions from the same global step plan, so the
collectives match along both mesh dimensions.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, register_fsdp_forward_method

from omni.models.encoders.base import HostSizes
from parallel.fsdp import shard_model
from omni.step.multiplex_rules import encoder_gradient_reduction, tower_reshards_after_backward


class MediaTower(nn.Module):
    def __init__(self, encoders: dict, projectors: dict):
        super().__init__()
        self.encoders = nn.ModuleDict(encoders)
        self.projectors = nn.ModuleDict(projectors)
        self.sharded = False
        self.compute_dtype: Optional[torch.dtype] = None  # FSDP's parameter dtype once sharded

    # Width of every modality's rows (the model's input_width): a projector without DeepStack
    # beside one with it (Qwen3-Omni's audio beside its vision) has its rows zero-padded to it,
    # as OmniModel.embed pads them, so that the runtime's row buffers have one width.
    row_width: Optional[int] = None

    @classmethod
    def take_from(cls, model: nn.Module) -> "MediaTower":
        """Move ``model.encoders`` / ``model.projectors`` into a tower (the model keeps empty ones)."""
        tower = cls(dict(model.encoders), dict(model.projectors))
        tower.row_width = getattr(model, "input_width", None)
        model.encoders, model.projectors = nn.ModuleDict(), nn.ModuleDict()
        return tower

    @property
    def modalities(self) -> list[str]:
        return list(self.encoders.keys())

    def output_dtype(self, device_type: str) -> torch.dtype:
        """The dtype of ``encode``'s rows: autocast's where it is on, else the projectors'
        compute dtype (FSDP's parameter dtype when sharded). A rank that encodes nothing in a
        call still exchanges its rows, and every rank must agree on their size in bytes."""
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        if self.compute_dtype is not None:
            return self.compute_dtype
        return next((p.dtype for p in self.projectors.parameters()), torch.float32)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def encode(self, modality: str, features: torch.Tensor, sizes: torch.Tensor,
               long_features: Optional[torch.Tensor] = None, long_sizes: Optional[torch.Tensor] = None,
               sp_group=None) -> torch.Tensor:
        """This rank's projected encoder rows for one chunk and modality: the short items'
        rows (item after item), then its pieces of the long items (``EncoderAnchor.encode_chunk``)."""
        whole = long_sizes is None  # the rows are whole items (the projector may lay them out)
        long_sizes = None if long_sizes is None else HostSizes(long_sizes)
        rows = self.encoders[modality].encode_chunk(features, HostSizes(sizes), long_features, long_sizes, sp_group)
        out = self.projectors[modality](rows, HostSizes(sizes) if whole else None)
        if self.row_width is not None and out.shape[1] < self.row_width:
            out = torch.nn.functional.pad(out, (0, self.row_width - out.shape[1]))
        return out

    def shard(self, mesh: DeviceMesh, precision: MixedPrecisionPolicy, reshard_after_forward: bool = True,
              prefetch: int = 1, weights: str = "sharded") -> list[nn.Parameter]:
        """FSDP2 over ``mesh`` (the encoder ranks; for ``weights="hybrid"`` a 2-D (replicate,
        shard) mesh, or a 1-D one where there is a single shard group). Returns the sharded
        parameters, whose gradients FSDP averages over the whole mesh (the caller turns them
        back into sums)."""
        sharded = []
        self.compute_dtype = precision.param_dtype
        self.reshard_after_forward = reshard_after_forward
        self.weights = weights
        for m, enc in self.encoders.items():
            layers = enc.layer_modules() if getattr(enc, "supports_sequence_parallel", False) else []
            for root, units in ((enc, [[layer] for layer in layers]), (self.projectors[m], [])):
                sharded += shard_model(root, units, mesh, precision=precision,
                                       reshard_after_forward=reshard_after_forward, prefetch=prefetch)
                # A rank with no items of this modality still reduces (zeros) for every parameter.
                root.set_reduce_scatter_unused_params(True)
            register_fsdp_forward_method(enc, "encode_chunk")
        self.sharded = True
        return sharded

    def before_backward(self, modality: str, last_of_step: bool, reduce_every_chunk: bool) -> None:
        """Sharded weights, before a chunk's backward through ``modality``. Resharding after
        each forward (least memory), the gradients are reduce-scattered in every chunk's
        backward if ``reduce_every_chunk`` (``parallel.fsdp_reduce_every_microbatch``), else
        accumulated until the step's last. Weights kept gathered after the forward stay
        gathered, with their gradients, until the step's last backward: one gather and one
        reduce-scatter per step and modality, as much traffic as the replicated all-reduce.
        Hybrid weights reduce-scatter inside their group as ``encoder_gradient_reduction``
        says, whether or not they stay gathered."""
        if not self.sharded:
            return
        reduce, all_reduce = encoder_gradient_reduction(self.weights, last_of_step, reduce_every_chunk,
                                                        self.reshard_after_forward)
        for module in (self.encoders[modality], self.projectors[modality]):
            module.set_requires_gradient_sync(reduce)  # sets both levels of HSDP's reduction ...
            module.set_requires_all_reduce(all_reduce)  # ... then the cross-group one on its own
            if not self.reshard_after_forward:
                module.set_reshard_after_backward(tower_reshards_after_backward(last_of_step, self.reshard_after_forward))
        encoder = self.encoders[modality]
        if last_of_step and not self.reshard_after_forward and not any(p.requires_grad for p in encoder.parameters()):
            # A frozen encoder has no backward, so FSDP never runs the post-backward that would
            # release its weights kept gathered: release them here, after the step's last
            # forward through it (no later chunk of the step has this modality). Local: no
            # collective.
            for unit in encoder.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()
