"""EncoderAnchor: the protocol every encoder plugin implements, plus the shared pieces.

An encoder plugin is an ``nn.Module`` subclass of :class:`EncoderAnchor` that brings

- ``modality`` and a ``Config`` dataclass (plain types, so Hydra/OmegaConf can back it);
- a weight-free, picklable *processor* (raw media -> :class:`~dataloading.formats.media.MediaItem`)
  that data-loading workers run, and that counts tokens from index metadata alone;
- ``forward(features, sizes)`` on *packed* input: the items of a micro-batch concatenated
  along the first axis, never padded to a common size; attention stays inside each item;
- optionally the three steps ``forward`` is made of (``embed_inputs`` -> ``encode_tokens`` ->
  ``finish``), which let :mod:`omni.models.encoders.sequence_parallel` split one long item
  over an SP group; an encoder that has them sets ``supports_sequence_parallel = True``;
- ``cost_coefficients()`` for the planner's cost model (FLOPs ~ alpha*n^2 + beta*n);
- ``from_pretrained(dir)`` for transformers checkpoints (config.json + safetensors).

The layers' building blocks the built-in encoders share (packed self-attention, activation
functions, the cost formulas) are ``omni.models.encoders.blocks``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from omni.models.attention import PackedSegments, uses_varlen_kernels
from omni.models.hf_checkpoint import CheckpointReader, read_hf_config
from omni.models.recompute import recompute

if TYPE_CHECKING:
    from omni.models.encoders.blocks import AttentionSpec
    from omni.models.projector import PretrainedProjector


class HostSizes:
    """Item sizes that stay on the host when passed to a sharded encoder's ``encode_chunk``:
    FSDP moves a root module's tensor arguments to the device, and encoders read sizes as
    numbers (a device copy would be read back, a synchronisation). FSDP leaves plain objects
    alone."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @staticmethod
    def unwrap(sizes):
        return sizes.tensor if isinstance(sizes, HostSizes) else sizes


class EncoderAnchor(nn.Module):
    """Base class of all encoder plugins. See the module docstring for the contract."""

    modality: ClassVar[str]
    Config: ClassVar[type]
    output_dim: int

    # --- transformers-checkpoint loading hooks (used by the generic ``from_pretrained``) ---
    #: model_type values in config.json this encoder can load.
    hf_model_types: ClassVar[Tuple[str, ...]] = ()
    #: key prefixes under which the encoder's weights may sit, tried in order.
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = ("",)
    #: True when the encoder implements embed_inputs / encode_tokens / finish / attention_heads,
    #: so a long item can be split over a Ulysses group (sequence_parallel.encode_long_items).
    supports_sequence_parallel: ClassVar[bool] = False
    #: ``model.attn_backend`` (set by the model builder): how items attend within themselves.
    attn_backend: str = "auto"
    #: ``parallel.encoder_activation_checkpoint`` (set by ``parallelize``): what each layer of
    #: ``encode_tokens`` keeps for backward (``omni.models.recompute``): none | selective | full.
    activation_checkpoint: str = "none"
    #: Spatial merge: the projector concatenates ``spatial_merge`` x ``spatial_merge``
    #: neighbouring patches into one LLM token (Qwen2-VL's patch merger), so the encoder emits
    #: each item's tokens in groups of ``tokens_per_row`` = spatial_merge ** 2 neighbours and
    #: an item of n tokens fills n / tokens_per_row LLM placeholders. 1: one token per row.
    spatial_merge: int = 1

    @property
    def tokens_per_row(self) -> int:
        """Encoder tokens per projected output row (LLM placeholder)."""
        return self.spatial_merge ** 2

    def __init__(self, config: Any):
        super().__init__()
        self.config = config

    # --- config ---------------------------------------------------------------------------
    @classmethod
    def build_config(cls, params: Optional[Mapping[str, Any]] = None) -> Any:
        """``params`` (dict, DictConfig or a ready ``Config``) -> ``Config``.

        An unknown key is a ``ValueError`` naming the key, the encoder and the valid keys.
        """
        if isinstance(params, cls.Config):
            return params
        params = _plain(params or {})
        if not isinstance(params, dict):
            raise ValueError(f"{cls.__name__}: encoder params must be a mapping, got {type(params).__name__}")
        names = [f.name for f in dataclasses.fields(cls.Config)]
        for key in params:
            if key not in names:
                raise ValueError(
                    f"unknown config key '{key}' for encoder {cls.__name__} ({cls.modality}); "
                    f"valid keys: {', '.join(names)}"
                )
        return cls.Config(**params)

    # --- the plugin contract ----------------------------------------------------------------
    @classmethod
    def processor(cls, config: Any):
        """A picklable, weight-free :class:`~dataloading.formats.media.MediaProcessor` for ``config``."""
        raise NotImplementedError

    def forward(self, features: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """features [sum n_units, feat_dim], sizes int64 [n_items, k] -> [sum tokens, output_dim]
        (tokens = num_tokens * tokens_per_row, in merge groups when ``spatial_merge`` > 1).

        Default: the three steps below with attention inside each item. A plugin may override
        ``forward`` alone instead (it then cannot run sequence-parallel)."""
        x, tokens = self.embed_inputs(features, sizes)
        if not tokens:  # no items: nothing to attend over, but keep the tail in the graph
            return self.finish(x)
        return self.finish(self.encode_tokens(x, self.item_attention(tokens, x.device)))

    def item_attention(self, tokens: Sequence[int], device: torch.device) -> "AttentionSpec":
        """How packed items of ``tokens`` attend within themselves: segment ids for the PyTorch
        path, or the varlen kernels' ``PackedSegments`` (``attn_backend``)."""
        varlen = bool(tokens) and uses_varlen_kernels(self.attn_backend, device)
        if not varlen and len(tokens) <= 1:
            return None  # one segment: no mask
        # The lengths are known here, on the host: the PyTorch path gets them too (nothing read back).
        return PackedSegments.from_lengths(list(tokens), device, causal=False,
                                           backend=self.attn_backend if varlen else "sdpa")

    # --- the steps of forward (optional; needed for sequence parallelism) -------------------
    def embed_inputs(self, features: torch.Tensor, sizes: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
        """The per-item front-end: features, sizes -> (token states [sum tokens, D], tokens per item)."""
        raise NotImplementedError(self._missing_step("embed_inputs"))

    def encode_tokens(self, x: torch.Tensor, attention: "AttentionSpec") -> torch.Tensor:
        """The transformer layers on token states [T, D]. ``attention``: segment ids [T] (None
        for a single item) or an object with ``attend(q, k, v, scale)`` that replaces local
        attention (see :func:`packed_self_attention`)."""
        raise NotImplementedError(self._missing_step("encode_tokens"))

    def run_layers(self, layers, x: torch.Tensor, attention: "AttentionSpec") -> torch.Tensor:
        """``encode_tokens``' loop: each layer ``layer(x, attention)`` under the encoder's
        activation checkpointing."""
        for layer in layers:
            x = recompute(layer, x, attention, mode=self.activation_checkpoint)
        return x

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The per-token tail after the layers (e.g. the final layernorm): [T, D] -> [T, output_dim]."""
        raise NotImplementedError(self._missing_step("finish"))

    def attention_heads(self) -> int:
        """Attention heads per layer (a Ulysses group must divide it)."""
        raise NotImplementedError(self._missing_step("attention_heads"))

    def input_units(self, sizes: torch.Tensor) -> List[int]:
        """Rows of ``features`` each item has (the multiplexing runtime slices features per
        item). Default: the product of the item's ``sizes`` entries (a grid of patches, a
        number of frames); override when features are laid out otherwise."""
        return [int(torch.tensor(row).prod()) if row else 0 for row in sizes.tolist()]

    def encode_chunk(self, features: torch.Tensor, sizes: torch.Tensor, long_features: Optional[torch.Tensor] = None,
                     long_sizes: Optional[torch.Tensor] = None, sp_group=None) -> torch.Tensor:
        """This rank's share of one encoder chunk of the multiplexing runtime, in one call: the
        short items whole, then its pieces of the long items split over ``sp_group`` (see
        :func:`omni.models.encoders.sequence_parallel.encode_chunk`). One method, so that FSDP
        can treat it as the forward (one gather of the weights per chunk)."""
        from omni.models.encoders.sequence_parallel import encode_chunk

        return encode_chunk(self, features, HostSizes.unwrap(sizes), long_features, HostSizes.unwrap(long_sizes),
                            sp_group)

    def layer_modules(self) -> List[nn.Module]:
        """The transformer layers, each gathered on its own when the encoder's weights are
        FSDP-sharded (``multiplex.encoder_weights=sharded``); the rest (front-end, final norm)
        is gathered for the whole call. Only used for encoders with the three steps, whose
        ``encode_chunk`` runs every layer once per call. Default: none (one unit)."""
        return []

    def activation_bytes(self, tokens: int, element_bytes: int = 4) -> Optional[float]:
        """Estimated bytes autograd keeps for backward while one item of ``tokens`` tokens is
        encoded (what ``multiplex.long_threshold=auto`` compares with the memory budget).
        None: unknown (the budget then never splits this encoder's items)."""
        return None

    # --- what `omni simulate` asks of a tower (omni.sim.spec), besides the above ----------------
    def feature_width(self) -> int:
        """Values per encoder token in ``features`` (what the multiplexing runtime sends to the
        GPU that encodes an item). Default: one patch's pixels (num_channels x patch_size^2)
        when the config has a patch size, else two mel frames (num_mel_bins x 2: Whisper's
        stride-2 stem)."""
        c = self.config
        if hasattr(c, "patch_size"):
            return int(getattr(c, "num_channels", 3)) * int(c.patch_size) ** 2
        return int(getattr(c, "num_mel_bins", 1)) * 2

    def simulated_item(self, units: int) -> Tuple[int, int]:
        """(encoder tokens, LLM rows) of one item of about ``units`` input units (an image of
        that many of this tower's patches, an audio clip of that many frames): what this
        tower's processor makes of it, for the simulator's drawn workloads. Encoder tokens are
        what ``cost_coefficients`` (per LLM row) and ``activation_bytes`` count, times
        ``tokens_per_row``. Default: a native-resolution tower, ``units`` rounded to whole
        merge groups."""
        k = self.tokens_per_row
        tokens = max(k, round(units / k) * k)
        return tokens, tokens // k

    def simulated_clip(self, frames: int, units: int) -> Tuple[int, int, int]:
        """(items, encoder tokens per item, LLM rows per item) of a video clip of ``frames``
        frames of about ``units`` patches each, for the simulator. Default: every frame an
        image item (a tower whose processor takes no video; MegaScale-Omni's workloads)."""
        return (frames, *self.simulated_item(units))

    def _missing_step(self, name: str) -> str:
        return (
            f"encoder {type(self).__name__} ({self.modality}) does not implement {name}(); "
            "implement forward(), or embed_inputs/encode_tokens/finish (plus attention_heads and "
            "input_units for sequence parallelism)"
        )

    def cost_coefficients(self) -> Tuple[float, float]:
        """(alpha, beta): forward FLOPs of one item of n tokens ~ alpha*n^2 + beta*n."""
        raise NotImplementedError

    # --- checkpoints ------------------------------------------------------------------------
    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        """config.json contents -> ``Config`` params. Default: the fields ``Config`` shares."""
        names = {f.name for f in dataclasses.fields(cls.Config)}
        return {k: v for k, v in hf_config.items() if k in names}

    @classmethod
    def params_from_preprocessor_config(cls, pp_config: Dict[str, Any]) -> Dict[str, Any]:
        """preprocessor_config.json contents (when the checkpoint has one) -> ``Config`` params."""
        return {}

    def convert_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Turn a checkpoint tensor into the shape of our parameter ``name`` (default: as is)."""
        return tensor

    @classmethod
    def pretrained_projector(cls, path: str) -> Optional["PretrainedProjector"]:
        """The projector the checkpoint at ``path`` holds beside this encoder (as Qwen-VL holds
        its merger), or None (default: the projector starts fresh)."""
        return None

    def new_projector(self, llm_width: int, **kwargs: Any) -> nn.Module:
        """A projector for this encoder into an LLM of ``llm_width`` (``kwargs``: ``Projector``'s
        shape arguments, from the slot, ``fresh_projector`` or the checkpoint). Default: Omni's
        ``Projector``, merging ``tokens_per_row`` tokens. A family whose projector lays items
        out (LLaVA-OneVision's tiles and newlines) returns its own module.

        The projector call contract: ``projector(rows, sizes)``, ``rows`` the encoder's output
        and ``sizes`` the items' sizes as the encoder got them when ``rows`` are whole items,
        item after item; None when they are not (pieces of long items split over a sequence-
        parallel group). A projector that reads ``sizes`` needs whole items, so its encoder
        must not set ``supports_sequence_parallel``; ``sizes`` may come wrapped in
        ``HostSizes`` (unwrap it)."""
        from omni.models.projector import Projector

        return Projector(self.output_dim, llm_width, merge=self.tokens_per_row, **kwargs)

    def fresh_projector(self) -> Dict[str, Any]:
        """``Projector`` arguments that fix the shape of a fresh projector (not loaded from a
        checkpoint), e.g. ``{"norm": "rms", "hidden": 1280}``: a tower whose family has a
        projector of its own (Qwen-VL's patch merger) gets that, so a model trained from scratch
        is a checkpoint of the family. Default: none (``projector.hidden_mult`` decides)."""
        return {}

    @classmethod
    def hf_name(cls, name: str) -> str:
        """The checkpoint's name (below the weight prefix) of our parameter ``name`` (default: the same)."""
        return name

    @classmethod
    def hf_parts(cls, name: str) -> Tuple[str, ...]:
        """The checkpoint's names (below the weight prefix) whose concatenation along the first
        axis is our parameter ``name``, for a checkpoint that stores it in parts where Omni
        fuses them (Qwen2.5-Omni's tower: q, k and v of a fused qkv); () where none does. Tried
        only when the checkpoint lacks ``hf_name(name)``."""
        return ()

    @classmethod
    def from_pretrained(cls, path: str, **overrides: Any) -> "EncoderAnchor":
        """Load a transformers checkpoint directory; ``overrides`` are ``Config`` params
        (e.g. a preprocessing budget) applied on top of config.json."""
        hf_config = read_hf_config(path)
        model_type = hf_config.get("model_type")
        if model_type not in cls.hf_model_types:
            raise ValueError(
                f"{path}: config.json has model_type {model_type!r}, but {cls.__name__} loads "
                f"{' / '.join(cls.hf_model_types)} checkpoints; pick the matching encoder"
            )
        params = cls.params_from_hf_config(hf_config)
        # The preprocessing settings where transformers 5 looks first: nested in the processor's
        # processor_config.json (what its save_pretrained writes), then preprocessor_config.json.
        # A line says which file, or that there is none: wrong pixels are otherwise silent.
        part = "feature_extractor" if cls.modality == "audio" else "image_processor"
        source = None
        for name, pick in (("processor_config.json", lambda d: d.get(part)), ("preprocessor_config.json", lambda d: d)):
            file = os.path.join(os.fspath(path), name)
            if os.path.isfile(file):
                with open(file) as f:
                    settings = pick(json.load(f))
                if isinstance(settings, dict):
                    source = file
                    params.update(cls.params_from_preprocessor_config(settings))
                    break
        if os.environ.get("RANK", "0") == "0":  # once per job, not once per rank
            print(f"omni: {cls.__name__} preprocessing from {source}" if source is not None else
                  f"omni: {path} has no processor_config.json ({part}) or preprocessor_config.json; "
                  f"{cls.__name__} preprocesses with its defaults", file=sys.stderr, flush=True)
        params.update(_plain(dict(overrides)))
        config = cls.build_config(params)
        with torch.device("meta"):
            model = cls(config)
        wanted = model.state_dict()
        reader = CheckpointReader(path)
        anchor = cls.hf_name(next(iter(wanted)))
        prefix = next((p for p in cls.hf_weight_prefixes if p + anchor in reader), None)
        if prefix is None:
            tried = ", ".join(repr(p + anchor) for p in cls.hf_weight_prefixes)
            raise ValueError(f"{path}: no {cls.__name__} weights found (looked for {tried})")
        names = {name: prefix + cls.hf_name(name) for name in wanted}
        parts = {name: tuple(prefix + p for p in cls.hf_parts(name)) for name, key in names.items() if key not in reader}
        parts = {name: keys for name, keys in parts.items() if keys and all(k in reader for k in keys)}
        missing = [key for name, key in names.items() if key not in reader and name not in parts]
        if missing:
            raise ValueError(f"{path}: checkpoint lacks {len(missing)} {cls.__name__} weights, e.g. {missing[0]}")
        dtype = torch.get_default_dtype()
        raw = reader.tensors([key for name, key in names.items() if name not in parts]
                             + [k for keys in parts.values() for k in keys])
        state = {}
        for name, ref in wanted.items():
            stored = torch.cat([raw[k] for k in parts[name]]) if name in parts else raw[names[name]]
            t = model.convert_hf_tensor(name, stored)
            if tuple(t.shape) != tuple(ref.shape):
                raise ValueError(
                    f"{path}: weight {names[name]} has shape {tuple(t.shape)}, "
                    f"expected {tuple(ref.shape)} from config.json"
                )
            state[name] = t.to(dtype) if t.is_floating_point() else t
        model.load_state_dict(state, strict=True, assign=True)
        return model


# ---------------------------------------------------------------------------------------------
# config helpers


def _plain(obj: Any) -> Any:
    """DictConfig/ListConfig (or any mapping/sequence) -> plain dict/list, recursively."""
    if isinstance(obj, (str, bytes)):
        return obj
    if isinstance(obj, Mapping) or (hasattr(obj, "items") and hasattr(obj, "keys")):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) or type(obj).__name__ == "ListConfig":
        return [_plain(v) for v in obj]
    return obj


def check_sizes(name: str, features: torch.Tensor, units_per_item: Iterable[int]) -> List[int]:
    units = [int(u) for u in units_per_item]
    if sum(units) != features.shape[0]:
        raise ValueError(
            f"{name}: sizes describe {sum(units)} input units but features has {features.shape[0]} rows"
        )
    return units
