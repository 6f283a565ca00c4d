"""Per-GPU memory of one pipeline stage: what stays between steps (weights, gradients, optimizer
state), the compute-dtype weight copies held during the step, what autograd keeps for backward
per micro-batch, and the short-lived peaks of the loss and of a layer's backward.

The activation terms are counted from what *our* decoder saves (omni/models/llm/layers.py,
moe.py, attention.py; torch.autograd.graph.saved_tensors_hooks, one count per storage), tensor by
tensor, so each term (``omni.sim.block_activations``) names the tensor it stands for; no
factor is fitted.
tests/sim/test_memory_model.py holds the sum to the measured peak of a real CPU training step.

Shapes follow the code, not an idealised model: under tensor parallelism the attention and
dense-MLP inputs are all-gathered to the whole row and kept so (the column-parallel
projections save their input), and MoE layers run on the sequence shard with replicated,
not TP-split, experts; MoE parameters are never FSDP-sharded (omni/runtime/parallelize.py).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from omni.models.llm.config import DecoderConfig
from omni.sim.block_activations import (FP32, INDEX, BlockRun, backward_workspace_bytes, dense_mlp_bytes,
                                      layer_bytes, moe_bytes, norm_bytes, saved_by_block, selective_bytes)
from omni.sim.spec import ModelSpec
from parallel.sizing import LOSS_CHUNK_BYTES, RING_SCORE_BYTES

GIB = float(2**30)


@dataclass
class MemoryBreakdown:  # bytes
    params: float = 0.0  # master/sharded parameters kept between steps
    grads: float = 0.0  # gradients (sharded, or unsharded while accumulating)
    optimizer: float = 0.0  # optimizer state
    gathered: float = 0.0  # FSDP-gathered (or autocast-cast) compute-dtype weights held during the step
    activations: float = 0.0  # saved for backward (filled by the caller from live micro-batches)
    transient: float = 0.0  # short-lived peaks (logits + their gradient in the loss, a layer's workspace)

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def gib(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) / GIB for f in fields(self)}
        out["total"] = self.total / GIB
        return out

    def __add__(self, other: "MemoryBreakdown") -> "MemoryBreakdown":
        return MemoryBreakdown(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


# -- parameters ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LayerParams:
    split: int  # split by TP, sharded by FSDP: attention projections, the dense MLP
    norms: int  # replicated over TP, sharded by FSDP
    moe_shared: int  # router, shared expert and its gate: replicated over TP, not FSDP-sharded
    experts: int  # routed experts: split by EP only


def _attention_params(c: DecoderConfig) -> int:
    h, qd, kvd = c.hidden_size, c.num_heads * c.resolved_head_dim(), c.num_kv_heads * c.resolved_head_dim()
    n = 2 * h * qd + 2 * h * kvd
    if c.attention_bias:
        n += qd + 2 * kvd
    return n + (h if c.o_proj_bias() else 0)


def _layer_params(spec: ModelSpec, i: int) -> _LayerParams:
    c = spec.llm
    # Qwen3's QK-norm gains (head_dim each) count with the norms: whole on every TP rank (under TP
    # they also stay outside FSDP: 2 x head_dim numbers a layer, left out of that split)
    qk = 2 * c.resolved_head_dim() if c.qk_norm() else 0
    norms, attn, experts = 2 * c.hidden_size + qk, _attention_params(c), spec.layer_expert_params[i]
    rest = spec.layer_params[i] - norms - attn - experts  # the dense MLP, or router + shared expert
    if c.is_moe_layer(i):
        return _LayerParams(attn, norms, rest, experts)
    return _LayerParams(attn + rest, norms, 0, 0)


def static_memory(spec: ModelSpec, layers, first: bool, last: bool, *, tp: int = 1, ep: int = 1, shard: int = 1,
                  master_bytes: int = 4, compute_bytes: int = 2, grad_bytes: int = 4,
                  optimizer_bytes_per_param: int = 8, gather_whole_stage: bool = False,
                  unsharded_grads: bool = False) -> MemoryBreakdown:
    """The LLM part of one GPU of a pipeline stage holding decoder layers ``layers`` (+ the
    embedding if ``first``, + final norm and LM head if ``last``; a tied last stage keeps a copy
    of the embedding as its head). ``shard``: FSDP ranks; ``gather_whole_stage``: the stage stays
    gathered for the step (reshard_after_forward=false, the default under PP); otherwise the
    current and the prefetched layer are. ``unsharded_grads``: gradients accumulate unsharded and
    are reduce-scattered once per step (fsdp_reduce_every_microbatch=false)."""
    per = [_layer_params(spec, i) for i in layers]
    fsdp = sum(p.split / tp + p.norms for p in per)  # FSDP-managed numel on this GPU before sharding
    # The embedding and the head are split by vocabulary under TP; they and the final norm are
    # the FSDP root's, which FSDP2 keeps gathered from the forward to the end of the backward.
    root = 0.0
    if first or (last and spec.head_params == 0):
        root += spec.embed_params / tp
    if last:
        root += spec.head_params / tp + spec.norm_params
    fsdp += root
    moe = sum(p.moe_shared + p.experts / ep for p in per)  # never sharded, never TP-split
    out = MemoryBreakdown()
    out.params = (fsdp / shard + moe) * master_bytes
    out.grads = (fsdp / (1 if unsharded_grads else shard) + moe) * grad_bytes
    out.optimizer = (fsdp / shard + moe) * optimizer_bytes_per_param
    if shard > 1:
        if gather_whole_stage:
            out.gathered = fsdp * compute_bytes
        else:  # the running layer, the prefetched one, and the root
            window = sorted((p.split / tp + p.norms for p in per), reverse=True)[:2]
            out.gathered = (sum(window) + root) * compute_bytes
    elif compute_bytes != master_bytes:
        # No FSDP: autocast casts each fp32 weight, and the casts are saved for backward (or
        # kept in the autocast cache under PP) until the layer's backward: the whole stage.
        out.gathered = fsdp * compute_bytes
    if compute_bytes != master_bytes:
        # MoE router and shared expert are fp32 leaves cast by autocast, whatever FSDP does; the
        # routed experts (this rank's) are cast once into a copy that every micro-batch in flight
        # shares (parallel/shared_cast.py), alive while one of them waits for its backward.
        out.gathered += sum(p.moe_shared + p.experts / ep for p in per) * compute_bytes
    return out


def _projector_params(spec: ModelSpec, modality: str) -> int:
    """The projector's share of ``EncoderSpec.params``: a two-layer MLP from the encoder width
    to the LLM width with biases, at the default ``projector.hidden_mult`` of 1 (the spec does
    not carry the multiplier)."""
    d, h = spec.encoders[modality].hidden, spec.hidden
    return d * h + h + h * h + h


def optimizer_step_transient_bytes(static: MemoryBreakdown) -> float:
    """The extra peak of the optimizer step (after the backward, with every gradient present
    and no activation): foreach AdamW, CUDA's default, builds sqrt(second moment) for a whole
    parameter group at once, and the decay group holds nearly every weight, so one
    master-dtype copy of the GPU's parameters (``static.params``, taken whole)."""
    return static.params


def encoder_static_memory(spec: ModelSpec, modality: str, *, shard: int = 1, master_bytes: int = 4,
                          compute_bytes: int = 2, grad_bytes: int = 4,
                          optimizer_bytes_per_param: int = 8, gather_whole: bool = False,
                          unsharded_grads: bool = False) -> MemoryBreakdown:
    """Encoder + projector of ``modality`` on one GPU (weights sharded over ``shard`` ranks;
    ``gather_whole``: the sharded weights stay gathered for the step, as the runtime keeps them
    under PP with reshard_after_forward=auto; ``unsharded_grads``: the gradients stay whole,
    in ``grad_bytes`` (FSDP's fp32 reduce dtype), until the step's last backward
    reduce-scatters them — ``media_tower.tower_grads_unsharded``).
    A frozen encoder (``encoders.<slot>.freeze``) has no gradients or optimizer state; its
    projector always trains (OmniModel freezes the encoder only)."""
    e = spec.encoders[modality]
    trained = e.params if e.trainable else min(e.params, _projector_params(spec, modality))
    out = MemoryBreakdown(params=e.params / shard * master_bytes)
    out.grads = trained / (1 if unsharded_grads else shard) * grad_bytes
    out.optimizer = trained / shard * optimizer_bytes_per_param
    if shard > 1 and gather_whole:
        out.gathered = e.params * compute_bytes
    elif shard > 1:  # gathered one FSDP unit (a layer, or the whole tower) at a time, plus the prefetched one
        out.gathered = min(2.0 / max(1, e.fsdp_units), 1.0) * e.params * compute_bytes
    elif compute_bytes != master_bytes:
        # Autocast casts of trainable weights are saved for backward; a frozen encoder's are
        # used and dropped one op at a time.
        out.gathered = trained * compute_bytes
    return out


# -- activations (summed over a stage's blocks: omni.sim.block_activations) ------------------


def llm_activation_bytes(spec: ModelSpec, layers, tokens: float, *, tp: int = 1, recompute: str = "none",
                         element_bytes: int = 2, first: bool = False, last: bool = False, ep: int = 1,
                         attention: str = "varlen", master_bytes: int = 4, offload=frozenset()) -> float:
    """Bytes autograd keeps for backward for ONE micro-batch of ``tokens`` tokens on this GPU
    (after CP slicing) through ``layers``, between its forward and its backward.

    ``recompute``: none | selective | full (``parallel.activation_checkpoint``). ``attention``:
    varlen (the flash / Triton kernels, what CUDA runs) or sdpa (the PyTorch path, the CPU's).
    ``master_bytes``: the parameters' dtype. ``offload``: the blocks whose saved tensors go to host
    memory (``parallel.activation_offload``; None: all), left out here: see ``offloaded_block_bytes``.
    Activations are taken in the compute dtype, as FSDP mixed precision gives; without FSDP,
    autocast keeps the residual stream in fp32 and casts each projection's input separately,
    which is more. The re-run of the block in backward is in ``layer_transient_bytes``."""
    r = BlockRun(spec.llm, tokens, tp, element_bytes, ep, master_bytes, attention)
    c, e = r.c, r.e
    layers = list(layers)
    saved = saved_by_block(r, recompute)
    total = 0.0
    for i, block in zip(layers, spec.by_kind(layers, lambda i: saved(r, i))):  # block by block, in order
        if offload is not None and i not in offload:
            total += block
    if layers:
        total += 2 * e * c.resolved_head_dim() * tokens  # rotary cos / sin, shared by the blocks
    if first:
        total += INDEX * tokens  # token ids, kept by the embedding for its gradient
    if last:
        # Final norm, the rows with a target (taken as every row) gathered for the head, the mask.
        total += norm_bytes(r) + e * c.hidden_size * tokens + tokens
    return total


def offloaded_block_bytes(spec: ModelSpec, layers, tokens: float, offload, *, tp: int = 1,
                          recompute: str = "none", element_bytes: int = 2, ep: int = 1, attention: str = "varlen",
                          master_bytes: int = 4) -> dict[int, float]:
    """Bytes each offloaded block of ``layers`` sends to host memory per micro-batch (what it keeps
    for its backward), by layer index. ``offload``: the offloaded blocks (None: all). The device
    holds two such blocks' worth during the backward: the block running and the one brought
    back ahead of it (``parallel/activation_offload.py``)."""
    r = BlockRun(spec.llm, tokens, tp, element_bytes, ep, master_bytes, attention)
    saved = saved_by_block(r, recompute)
    layers = list(layers)
    return {i: b for i, b in zip(layers, spec.by_kind(layers, lambda i: saved(r, i)))
            if offload is None or i in offload}


def layer_transient_bytes(spec: ModelSpec, layers, tokens: float, *, tp: int = 1, recompute: str = "none",
                          element_bytes: int = 2, ep: int = 1, attention: str = "varlen",
                          master_bytes: int = 4, ring: bool = False) -> float:
    """The extra peak while one block runs its backward, counted once per GPU (one block runs
    its backward at a time): what the block re-creates under recompute beyond what stayed
    kept, the gradient arriving at the block, and the block's backward workspace at its worst
    moment. On the last stage take max(this, head_transient_bytes): the loss is done before
    the first block's backward. (The sum with the activations over-counts slightly: the last
    stage's final-norm and head tensors of the running micro-batch are freed by then.)
    ``ring``: attention is ring CP attention, whose backward holds ``ring_workspace_bytes``
    after the block's MLP and second norm have run their backward (their saved tensors freed)."""
    r = BlockRun(spec.llm, tokens, tp, element_bytes, ep, master_bytes, attention)
    kind_of, first_of_kind = spec.layer_kinds()  # the worst block is the worst kind's (max: order-free)
    worst = 0.0
    for i in (first_of_kind[k] for k in sorted({kind_of[i] for i in layers})):
        redo = 0.0
        if recompute != "none":
            # The re-run block holds everything a block without recompute saves; what recompute
            # kept for it (the block input; under selective the matmul outputs, which the re-run
            # takes over, dropping those backward does not read) is in the activations already.
            # In fp32 the block input is also the first norm's saved input, counted in layer_bytes.
            block_input = r.e * r.c.hidden_size * r.n
            kept = block_input if recompute == "full" else selective_bytes(r, i)
            redo = layer_bytes(r, i) + (0.0 if r.e == FP32 else block_input) - kept
        workspace = backward_workspace_bytes(r, i)
        if ring:
            freed = norm_bytes(r) + (moe_bytes(r) if r.c.is_moe_layer(i) else dense_mlp_bytes(r))
            workspace = max(workspace, ring_workspace_bytes(spec, tokens, tp=tp) - freed)
        worst = max(worst, redo + r.e * r.c.hidden_size * r.n + workspace)
    return worst


def ring_workspace_bytes(spec: ModelSpec, tokens: float, *, tp: int = 1) -> float:
    """The extra peak inside a block's ring attention (context parallelism, ``cp_impl=ring``)
    beyond its saved tensors: about three fp32 score buffers of one chunk of query rows against
    the rank's ``tokens`` keys, each within ``RING_SCORE_BYTES`` (``parallel/ring_attention.py``)."""
    heads = spec.llm.num_heads / tp
    return 3 * min(RING_SCORE_BYTES, FP32 * heads * tokens * tokens)


def head_transient_bytes(spec: ModelSpec, tokens: float, *, tp: int = 1, element_bytes: int = 2) -> float:
    """The extra peak on the last stage during the loss and its backward, for ``tokens`` target
    tokens (rows with a label; the micro-batch's tokens are an upper bound), as
    parallel/linear_cross_entropy.py runs it: the head and the cross-entropy in chunks of ``c``
    targets whose fp32 logits stay within ``LOSS_CHUNK_BYTES``, the logits recomputed in the
    backward. Under TP each rank has ``V / tp`` vocabulary rows. The weight arrives in the compute
    dtype (FSDP's gathered copy). Two moments of the backward, whichever is larger:
    (a) scaling a chunk's softmax: its fp32 logits, softmax and scaled gradient and the gradient's
    compute-dtype cast, with the fp32 head-gradient buffer; (b) adding a chunk's head gradient:
    the fp32 logits and the cast gradient, the buffer, the chunk's product in the compute dtype
    and its fp32 copy (in fp32 the casts are the tensors themselves). Plus the hidden rows' gradient, allocated before the chunks."""
    c, e = spec.llm, element_bytes
    v = c.vocab_size / tp
    rows = min(tokens, max(1, LOSS_CHUNK_BYTES // (FP32 * max(v, 1))))
    head = v * c.hidden_size
    cast = e if e != FP32 else 0  # the casts to the compute dtype are no-ops in fp32
    scale_softmax = (3 * FP32 + cast) * rows * v + FP32 * head
    add_gradient = (FP32 + e) * rows * v + (FP32 + e + cast) * head
    return max(scale_softmax, add_gradient) + e * tokens * c.hidden_size


def encoder_activation_bytes(spec: ModelSpec, modality: str, tokens: float, *, sp: int = 1) -> float:
    """What autograd keeps (bf16) while ``tokens`` encoder tokens are encoded and projected,
    split over ``sp`` sequence-parallel ranks: the encoder's own estimate
    (EncoderAnchor.activation_bytes, per token; nothing when the encoder is frozen: no weight
    and no input of it needs a gradient, so no graph is recorded) plus the projector's input,
    hidden state and activation output."""
    e = spec.encoders[modality]
    per_token = e.activation_bytes_per_token if e.trainable else 0.0
    # the projector's input (and its norm's, with a spatial merge) per encoder token, its hidden
    # state and output per row of tokens_per_row tokens
    per_token += 2 * (e.hidden * (2 if e.tokens_per_row > 1 else 1) + 2 * spec.hidden / e.tokens_per_row)
    return per_token * tokens / sp