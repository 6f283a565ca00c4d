"""What one decoder block keeps for its backward and holds during it, tensor by tensor: each
term counted from what *our* decoder saves (omni/models/llm/layers.py, moe.py, attention.py) and
named after the tensor it stands for. ``omni.sim.memory`` sums them over a stage's blocks."""
from __future__ import annotations

from dataclasses import dataclass

from omni.models.llm.config import DecoderConfig

FP32 = 4  # RMSNorm statistics, router probabilities, attention log-sum-exp, logits in the loss
INDEX = 8  # int64 index tensors


@dataclass(frozen=True)
class BlockRun:
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


def norm_bytes(r: BlockRun) -> float:
    """RMSNorm on the shard: the fp32 input (its upcast; in fp32 the input itself) for the
    statistics' gradient, the normalised value before the gain (the gain's gradient), and the
    1/rms per token. The gain's output is its consumer's input, counted there."""
    return (FP32 * r.c.hidden_size + r.e * r.c.hidden_size + FP32) * r.n


def attention_bytes(r: BlockRun) -> float:
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


def dense_mlp_bytes(r: BlockRun) -> float:
    """SwiGLU: its (gathered) input, then gate(x), up(x), silu(gate) and silu * up (down's input)."""
    return r.e * r.c.hidden_size * r.tokens + 4 * r.e * r.c.intermediate_size * r.n


def shared_expert_bytes(r: BlockRun) -> float:
    """Qwen2-MoE's shared expert: SwiGLU intermediates, its output and the sigmoid gate (kept by
    their product)."""
    s = r.c.shared_expert_intermediate_size
    return (4 * r.e * s + r.e * r.c.hidden_size + r.e) * r.n if s else 0.0


def moe_bytes(r: BlockRun) -> float:
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
    return per_token * r.n + shared_expert_bytes(r)


def layer_bytes(r: BlockRun, i: int) -> float:
    """What block ``i`` saves for backward without recompute."""
    return 2 * norm_bytes(r) + attention_bytes(r) + (moe_bytes(r) if r.c.is_moe_layer(i) else dense_mlp_bytes(r))


def selective_bytes(r: BlockRun, i: int) -> float:
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


def saved_by_block(r: BlockRun, recompute: str):
    """What one block keeps for its backward under ``recompute``: a function of (run, layer)."""
    if recompute == "none":
        return layer_bytes
    if recompute == "selective":
        return selective_bytes
    if recompute == "full":
        return lambda r, i: r.e * r.c.hidden_size * r.n  # the block input, kept by the checkpoint
    raise ValueError(f"recompute {recompute!r} is not one of none, selective, full")


def backward_workspace_bytes(r: BlockRun, i: int) -> float:
    """Gradients in flight inside a block's backward beyond its saved tensors, at the worst
    moment (the moments are those of our code, found by tracking every storage; the counts
    name what is alive then)."""
    c, e, n = r.c, r.e, r.n
    if not c.is_moe_layer(i):
        # SwiGLU: at silu * up's backward, the gradients of its output and of one factor.
        return 2 * e * c.intermediate_size * n
    h, k, ie = c.hidden_size, c.num_experts_per_tok, c.expert_intermediate_size()
    shared = shared_expert_bytes(r)
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
