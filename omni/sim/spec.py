"""What the simulator knows of a model: its shapes, parameter counts per part, and the shared
cost model — all read from the real model built on the ``meta`` device (no weights are made),
so a 175B backbone costs nothing to describe and every count is the training code's own.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from dataclasses import dataclass, field

import torch

from dataloading.plan.cost import CostModel
from omni.errors import ConfigError
from omni.models.config import EncoderSlot, ModelConfig
from omni.models.llm.config import DecoderConfig


@dataclass(frozen=True)
class EncoderSpec:
    modality: str
    num_layers: int
    hidden: int
    heads: int
    params: int  # encoder + projector
    trainable: bool
    alpha: float  # forward FLOPs of one item of n encoder tokens: alpha * n^2 + beta * n
    beta: float
    activation_bytes_per_token: float  # bf16, what autograd keeps per encoder token (EncoderAnchor)
    feature_bytes_per_token: float  # input feature row (patch pixels / mel frame) in bf16
    supports_sp: bool = False  # long items may be split over multiplex.encoder_sp ranks
    # Encoder tokens per LLM placeholder (the projector's spatial merge: 4 for 2x2). The shared
    # cost model counts an item by its placeholders; alpha and beta here are per encoder token.
    tokens_per_row: int = 1
    # parallel.encoder_activation_checkpoint: none | selective | full (activation_bytes_per_token
    # is what is kept under it; the backward recomputes the rest).
    recompute: str = "none"
    # Units FSDP gathers one at a time when the weights are sharded (the tower's layers if it
    # runs sequence-parallel, else the whole tower: omni.multiplex.media_tower.shard's rule).
    fsdp_units: int = 1
    # The tower's answers for drawn workloads (EncoderAnchor.simulated_item / simulated_clip):
    # units -> (encoder tokens, LLM rows); (frames, units) -> (items, tokens, rows) per item.
    item: Callable[[int], tuple[int, int]] | None = field(default=None, compare=False, repr=False)
    clip: Callable[[int, int], tuple[int, int, int]] | None = field(default=None, compare=False, repr=False)


@dataclass
class ModelSpec:
    llm: DecoderConfig
    cost: CostModel  # forward FLOPs (omni.models.cost.default_cost_model)
    layer_params: list[int]  # every parameter of decoder layer i
    layer_active: list[int]  # parameters one token multiplies through in layer i (top-k experts)
    layer_expert_params: list[int]  # of layer_params, the routed experts' (sharded over ep)
    embed_params: int
    head_params: int  # LM head (0 when tied to the embedding)
    norm_params: int
    encoders: dict[str, EncoderSpec] = field(default_factory=dict)
    processors: dict = field(default_factory=dict)  # modality -> MediaProcessor (data.source=mixture)
    # Width of the media rows the multiplexer sends to the LLM (OmniModel.input_width): the LLM's,
    # times 1 + the DeepStack layers (Qwen3-VL's rows carry their residuals); 0: the LLM's.
    row_width: int = 0
    _kinds: tuple | None = field(default=None, init=False, repr=False, compare=False)  # layer_kinds()

    @property
    def num_layers(self) -> int:
        return self.llm.num_layers

    def layer_kinds(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(each decoder layer's kind, one layer of each kind): layers of one kind have the same
        parameters, active parameters, expert parameters and MoE-ness, so they cost the same
        per token. The simulator prices each kind once per stage and micro-batch instead of
        each layer (an 80-layer stage is one or two kinds)."""
        if self._kinds is None:
            c = self.llm
            keys = [(self.layer_active[i], self.layer_params[i], self.layer_expert_params[i], c.is_moe_layer(i))
                    for i in range(c.num_layers)]
            first = {}
            for i, key in enumerate(keys):
                first.setdefault(key, i)
            order = list(first)
            self._kinds = (tuple(order.index(key) for key in keys), tuple(first[key] for key in order))
        return self._kinds

    def by_kind(self, layers, price: Callable[[int], Any]) -> Iterator[Any]:
        """``price(i)`` for each layer ``i`` of ``layers``, in order, asked once per kind
        (``layer_kinds``): what a layer costs depends on its kind alone. Summing what this
        yields adds the same numbers in the same order as pricing every layer would."""
        kind_of, first_of_kind = self.layer_kinds()
        priced = {}
        for i in layers:
            k = kind_of[i]
            if k not in priced:
                priced[k] = price(first_of_kind[k])
            yield priced[k]

    @property
    def hidden(self) -> int:
        return self.llm.hidden_size

    @property
    def media_row_width(self) -> int:
        """Values per media row in the encoders' output exchanges (``row_width``)."""
        return self.row_width or self.hidden

    def llm_params(self) -> int:
        return sum(self.layer_params) + self.embed_params + self.head_params + self.norm_params

    def attention_alpha_per_layer(self) -> float:
        """Causal attention forward FLOPs per layer per token pair (the cost model's alpha / layers)."""
        return self.cost.alpha / self.llm.num_layers

    def mfu_flops(self, doc_lengths, media) -> float:
        """Training FLOPs counted for MFU (PaLM / Megatron convention: 6 x active parameters per
        token plus 12 x layers x heads x head_dim per token pair, not halved for causality, no
        recomputation), LLM and encoders. ``media``: (modality, encoder tokens, LLM rows) items."""
        c = self.llm
        active = sum(self.layer_active) + (self.head_params or self.embed_params)  # a tied head is the embedding
        attn = 12.0 * c.num_layers * c.num_heads * c.resolved_head_dim()
        total = 0.0
        for L in doc_lengths:
            total += 6.0 * active * L + attn * L * L
        for modality, n, *_ in media:  # (modality, encoder tokens, LLM rows)
            e = self.encoders[modality]
            # The shared cost model's encoder alpha is the attention term (not halved: encoders
            # attend both ways), beta the linear one: training = 3 x forward.
            total += 3.0 * (e.alpha * n * n + e.beta * n) * (1.0 if e.trainable else 1.0 / 3.0)
        return total


def model_spec(model_cfg: ModelConfig, slots: dict[str, EncoderSlot], encoder_recompute: str = "none") -> ModelSpec:
    """Build the model on the meta device and read its structure. ``encoder_recompute``:
    ``parallel.encoder_activation_checkpoint``, which sets what the encoders keep."""
    from omni.models.build import build_model, media_processors
    from omni.models.cost import default_cost_model

    with torch.device("meta"):
        model = build_model(model_cfg, slots, vocab_needed=0)
    llm = model.llm
    c = llm.config
    layers = list(llm.layers)
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    expert = [sum(p.numel() for n, p in layer.named_parameters() if ".experts." in f".{n}") for layer in layers]
    active = llm.active_params_per_layer()
    embed = llm.embed_tokens.weight.numel()
    head = 0 if c.tie_word_embeddings else sum(p.numel() for p in llm.lm_head.parameters())
    norm = sum(p.numel() for p in llm.norm.parameters())
    for modality, enc in model.encoders.items():
        _ask(enc, modality, "cost_coefficients")  # one line, not a traceback, for a tower without a cost
    cost = default_cost_model(model)
    encoders = {}
    for modality, enc in model.encoders.items():
        # The cost model's coefficients are per placeholder (k encoder tokens each): per token
        # the encoder's own, and the projector's matmuls spread over the k tokens of a row.
        k = enc.tokens_per_row
        enc.activation_checkpoint = encoder_recompute
        a, b = cost.encoders[modality]
        a, b = a / (k * k), b / k
        params = sum(p.numel() for p in enc.parameters()) + sum(p.numel() for p in model.projectors[modality].parameters())
        per_token = enc.activation_bytes(1024, element_bytes=2)
        heads, layers, width = (_ask(enc, modality, name) for name in ("attention_heads", "layer_modules",
                                                                       "feature_width"))
        if not layers:
            raise ConfigError(f"encoders: {type(enc).__name__} ({modality}) lists no layers (layer_modules()); the "
                              f"simulator counts a call's kernels and its weights' FSDP units by them: implement it")
        sp = bool(getattr(enc, "supports_sequence_parallel", False))
        encoders[modality] = EncoderSpec(
            modality=modality, num_layers=len(layers), hidden=int(enc.output_dim), heads=int(heads),
            params=int(params), trainable=any(p.requires_grad for p in enc.parameters()), alpha=float(a), beta=float(b),
            activation_bytes_per_token=(per_token or 0.0) / 1024.0, feature_bytes_per_token=2.0 * int(width),
            supports_sp=sp, tokens_per_row=int(k), recompute=encoder_recompute, fsdp_units=len(layers) if sp else 1,
            item=enc.simulated_item, clip=enc.simulated_clip)
    return ModelSpec(c, cost, layer_params, active, expert, embed, head, norm, encoders, media_processors(model),
                     row_width=int(model.input_width))


def _ask(enc, modality: str, name: str):
    """``enc.name()``, or one line naming the tower and the method it lacks."""
    try:
        return getattr(enc, name)()
    except NotImplementedError:
        raise ConfigError(f"encoders: {type(enc).__name__} ({modality}) does not implement {name}(), which the "
                          f"simulator needs (docs/simulate.md, \"What the simulator asks of an encoder\")") from None


def describe_model(spec: ModelSpec) -> dict[str, Any]:
    return {"llm_params_b": spec.llm_params() / 1e9, "layers": spec.num_layers, "hidden": spec.hidden,
            "encoders": {m: {"params_b": e.params / 1e9, "layers": e.num_layers, "hidden": e.hidden}
                         for m, e in spec.encoders.items()}}
