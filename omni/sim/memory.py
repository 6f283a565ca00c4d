"""Per-GPU memory of one pipeline stage: what stays between steps (weights, gradients, optimizer
state), the compute-dtype weight copies held during the step, what autograd keeps for backward
per micro-batch, and the short-lived peaks of the loss and of a layer's backward.

The activation terms are counted from what *our* decoder saves (omni/models/llm/layers.py,
moe.py, attention.py; torch.autograd.graph.saved_tensors_hooks, one count per storage), tensor by
tensor, so each term below names the tensor it stands for; no factor is fitted.
tests/sim/test_memory_model.py holds the sum to the measured peak of a real CPU training step.

Shapes follow the code, not an idealised model: under tensor parallelism the attention and
dense-MLP inputs are all-gathered to the whole row and kept so (the column-parallel
projections save their input), and MoE layers run on the sequence shard with replicated,
not TP-split, experts; MoE parameters are never FSDP-sharded (omni/runtime/parallelize.py).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from omni.models.llm.config import DecoderConfig
from omni.sim.spec import ModelSpec
from parallel.sizing import LOSS_CHUNK_BYTES, RING_SCORE_BYTES

GIB = float(2**30)
FP32 = 4  # RMSNorm statistics, router probabilities, attention log-sum-exp, logits in the loss
INDEX = 8  # int64 index tensors


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
    norms, attn, experts = 2 * c.hidden_size, _attention_params(c), spec.layer_expert_params[i]
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


# -- activations -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Run:
    """One micro-batch through one GPU's blocks: ``tokens`` of the row (after CP slicing),
    ``n`` of them on this TP rank between blocks (sequence parallelism), activations of ``e``
    bytes, weights of ``master`` bytes (the autocast source), ``kernel`` the attention path."""

    c: DecoderConfig
    tokens: float
    tp: int
    e: int
    ep: int
    master: int
    kernel: str

    @property
    def n(self) -> float:
        return self.tokens / self.tp


def _norm(r: _Run) -> float:
    """RMSNorm on the shard: the fp32 input (its upcast; in fp32 the input itself) for the
    statistics' gradient, the normalised value before the gain (the gain's gradient), and the
    1/rms per token. The gain's output is its consumer's input, counted there."""
    return (FP32 * r.c.hidden_size + r.e * r.c.hidden_size + FP32) * r.n


def _attention(r: _Run) -> float:
    """Self-attention of a block (the first norm excluded)."""
    c, e = r.c, r.e
    heads, qd, kvd = c.num_heads, c.num_heads * c.resolved_head_dim(), c.num_kv_heads * c.resolved_head_dim()
    gathered_input = e * c.hidden_size * r.tokens  # the normed row, all-gathered under SP: q/k/v's input
    if r.kernel == "varlen":
        # Flash/Triton varlen kernels keep q, k, v (GQA: k/v at their own width), the output
        # (which is also o_proj's input: the transposes back are views) and the log-sum-exp.
        return gathered_input + (e * (2 * qd + 2 * kvd) + FP32 * heads) * r.n
    if r.kernel == "sdpa":
        # PyTorch path on a packed row (omni.kernels.segment_attention._bucketed_attention): k/v repeated
        # to every head; SDPA keeps its q, k, v bucket gathers, output and log-sum-exp;
        # index_copy keeps the re-assembled outputs (its source); o_proj keeps a contiguous copy.
        # Plus the gather / scatter indices (int64) and the bucket-padding mask (bool).
        return gathered_input + (e * 6 * qd + FP32 * heads) * r.n + (2 * INDEX + 1) * r.tokens
    raise ValueError(f"attention kernel {r.kernel!r} is not one of varlen, sdpa")


def _dense_mlp(r: _Run) -> float:
    """SwiGLU: its (gathered) input, then gate(x), up(x), silu(gate) and silu * up (down's input)."""
    return r.e * r.c.hidden_size * r.tokens + 4 * r.e * r.c.intermediate_size * r.n


def _shared_expert(r: _Run) -> float:
    """Qwen2-MoE's shared expert: SwiGLU intermediates, its output and the sigmoid gate (kept by
    their product)."""
    s = r.c.shared_expert_intermediate_size
    return (4 * r.e * s + r.e * r.c.hidden_size + r.e) * r.n if s else 0.0


def _moe(r: _Run) -> float:
    """A MoE MLP on the sequence shard (MoE layers are not TP-split), each token routed to k
    experts (no capacity limit; under EP the rows received balance the rows sent)."""
    c, e = r.c, r.e
    h, k, ie, nx = c.hidden_size, c.num_experts_per_tok, c.expert_intermediate_size(), c.num_experts
    per_token = e * h  # the normed input: router's, shared expert's and the expert rows' source
    per_token += FP32 * nx  # router probabilities (softmax output, also the aux loss's)
    if c.router_z_loss_coef:
        per_token += FP32 * nx + FP32  # fp32 logits and their log-sum-exp for the z-loss
    per_token += INDEX * k  # top-k expert ids
    if c.norm_topk_prob:
        per_token += FP32 * k + FP32  # top-k probabilities and their sum (the division's inputs)
    per_token += e * k  # routing weights, kept by the weighted sum of the k outputs
    per_token += INDEX * k + e * k * h  # the sort gather's index and its rows (the experts' inputs)
    per_token += k * 4 * e * ie  # per routed row: gate_up output (2 ie), silu(gate), silu * up
    per_token += INDEX * k + e * k * h  # inverse permutation and the un-permuted expert outputs
    # (The routed experts' compute-dtype copy is shared by the micro-batches in flight: counted
    # once per stage, in static_memory's gathered weights.)
    return per_token * r.n + _shared_expert(r)


def _layer(r: _Run, i: int) -> float:
    """What block ``i`` saves for backward without recompute."""
    return 2 * _norm(r) + _attention(r) + (_moe(r) if r.c.is_moe_layer(i) else _dense_mlp(r))


def _selective(r: _Run, i: int) -> float:
    """Selective recompute (omni.models.recompute.SAVE_OPS): the block input plus every matmul output and the
    aten SDPA outputs; norms, activations, rotary and indexing are recomputed (so are the
    varlen kernels: they are not aten ops). Row-parallel outputs (o_proj, down_proj) are kept
    before their reduce-scatter: whole rows."""
    c, e, n = r.c, r.e, r.n
    h, heads = c.hidden_size, c.num_heads
    qd, kvd = heads * c.resolved_head_dim(), c.num_kv_heads * c.resolved_head_dim()
    out = e * h * n  # block input
    out += e * (qd + 2 * kvd) * n  # q, k, v projections
    if r.kernel == "sdpa":
        out += (e * qd + FP32 * heads) * n  # the aten kernel's output and log-sum-exp
    out += e * h * r.tokens  # o_proj output
    if c.is_moe_layer(i):
        k, ie, s = c.num_experts_per_tok, c.expert_intermediate_size(), c.shared_expert_intermediate_size
        out += e * c.num_experts * n  # router logits
        out += e * k * (2 * ie + h) * n  # experts' gate_up and down outputs, per routed row
        if s:
            out += e * (2 * s + h + 1) * n  # shared expert's gate, up, down and its gate's logit
    else:
        out += 2 * e * c.intermediate_size * n + e * h * r.tokens  # gate, up; down
    return out


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
    r = _Run(spec.llm, tokens, tp, element_bytes, ep, master_bytes, attention)
    c, e = r.c, r.e
    layers = list(layers)
    saved = _saved_by_block(r, recompute)
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
        total += _norm(r) + e * c.hidden_size * tokens + tokens
    return total


def _saved_by_block(r: _Run, recompute: str):
    """What one block keeps for its backward under ``recompute``: a function of (run, layer)."""
    if recompute == "none":
        return _layer
    if recompute == "selective":
        return _selective
    if recompute == "full":
        return lambda r, i: r.e * r.c.hidden_size * r.n  # the block input, kept by the checkpoint
    raise ValueError(f"recompute {recompute!r} is not one of none, selective, full")


def offloaded_block_bytes(spec: ModelSpec, layers, tokens: float, offload, *, tp: int = 1,
                          recompute: str = "none", element_bytes: int = 2, ep: int = 1, attention: str = "varlen",
                          master_bytes: int = 4) -> dict[int, float]:
    """Bytes each offloaded block of ``layers`` sends to host memory per micro-batch (what it keeps
    for its backward), by layer index. ``offload``: the offloaded blocks (None: all). The device
    holds two such blocks' worth during the backward: the block running and the one brought
    back ahead of it (``parallel/activation_offload.py``)."""
    r = _Run(spec.llm, tokens, tp, element_bytes, ep, master_bytes, attention)
    saved = _saved_by_block(r, recompute)
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
    r = _Run(spec.llm, tokens, tp, element_bytes, ep, master_bytes, attention)
    kind_of, first_of_kind = spec.layer_kinds()  # the worst block is the worst kind's (max: order-free)
    worst = 0.0
    for i in (first_of_kind[k] for k in sorted({kind_of[i] for i in layers})):
        redo = 0.0
        if recompute != "none":
            # The re-run block holds everything a block without recompute saves; what recompute
            # kept for it (the block input; under selective the matmul outputs, which the re-run
            # takes over, dropping those backward does not read) is in the activations already.
            # In fp32 the block input is also the first norm's saved input, counted in _layer.
            block_input = r.e * r.c.hidden_size * r.n
            kept = block_input if recompute == "full" else _selective(r, i)
            redo = _layer(r, i) + (0.0 if r.e == FP32 else block_input) - kept
        workspace = _backward_workspace(r, i)
        if ring:
            freed = _norm(r) + (_moe(r) if r.c.is_moe_layer(i) else _dense_mlp(r))
            workspace = max(workspace, ring_workspace_bytes(spec, tokens, tp=tp) - freed)
        worst = max(worst, redo + r.e * r.c.hidden_size * r.n + workspace)
    return worst


def _backward_workspace(r: _Run, i: int) -> float:
    """Gradients in flight inside a block's backward beyond its saved tensors, at the worst
    moment (the moments are those of our code, found by tracking every storage; the counts
    name what is alive then)."""
    c, e, n = r.c, r.e, r.n
    if not c.is_moe_layer(i):
        # SwiGLU: at silu * up's backward, the gradients of its output and of one factor.
        return 2 * e * c.intermediate_size * n
    h, k, ie = c.hidden_size, c.num_experts_per_tok, c.expert_intermediate_size()
    shared = _shared_expert(r)
    # (a) The start: the weighted sum's backward holds the gradient of the k outputs and a
    # temporary of the same size for the routing weights' gradient; with a shared expert, whose
    # backward runs first (and then frees its tensors), its output and gate gradients.
    start = 2 * e * k * h * n
    if shared:
        start = max(2 * e * h * n, start - shared)
    # (b) The routed experts' weight gradients: ``w_gate_up[e]`` is a select of the stacked
    # parameter, whose backward materialises a zero gradient of the whole stack (masters'
    # dtype) per expert, and autograd sums them out of place. From the second expert on: the
    # gate_up running sum, the incoming one and their sum (3 stacks) plus the down sum (1).
    # By then the shared expert, the weighted outputs and two experts' tensors are freed; those
    # two experts' input gradients (and the shared expert's) wait for the split's backward.
    local = max(1, c.num_experts // r.ep)
    if local >= 2:
        stacks, done = r.master * 7 * local * ie * h, 2
    else:
        stacks, done = r.master * 3 * ie * h, 1
    experts = stacks + done / local * k * n * e * (h - 4 * ie)
    if shared:
        experts += e * h * n - shared
    return max(start, experts)


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
