"""The simulator's memory model (omni/sim/memory.py) against the measured peak of real CPU
training steps: forward + backward + AdamW step of small models with random weights, one
process. The peak is the CPU analogue of torch.cuda.max_memory_allocated: every storage
alive at once (parameters, optimizer state, gradients, saved activations, temporaries), each
counted once however many views share it. Predicted exactly as the simulator composes it:
static (params, grads, optimizer) + one micro-batch's activations + max(loss, block) transient.
Run with -s to see the table (measured, predicted, relative error).
"""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dataloading.construct.batch import IGNORE_INDEX, MicroBatch
from omni.models.build import build_model
from omni.models.config import ModelConfig
from omni.runtime.config import OptimConfig
from omni.runtime.optim import build_optimizer
from omni.sim import memory
from omni.sim.spec import model_spec

TOLERANCE = 0.10
MIB = 2**20
# Four documents in one packed row (bucketed attention pads 1024 real tokens to 1094); bf16
# matmuls are slow on the CPU, so the bf16 cases pack half as many.
DOCS = {torch.float32: [300, 280, 250, 194], torch.bfloat16: [150, 140, 125, 97]}

DENSE = dict(family="llama", vocab_size=512, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4,
             num_kv_heads=2)
# Tied head, q/k/v biases, one KV head (GQA 4:1).
QWEN = dict(DENSE, family="qwen2", tie_word_embeddings=True, attention_bias=True, num_kv_heads=1)
MOE = dict(DENSE, family="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=352,
           shared_expert_intermediate_size=352)
# More experts, top-1, no shared expert: the experts' stacked weight gradients dominate a
# block's backward.
MIXTRAL = dict(DENSE, family="mixtral", num_experts=8, num_experts_per_tok=1, moe_intermediate_size=512)

CASES = [
    ("dense", DENSE, "none", torch.float32),
    ("dense", DENSE, "selective", torch.float32),
    ("dense", DENSE, "full", torch.float32),
    ("qwen2-tied-gqa", QWEN, "none", torch.float32),
    ("moe", MOE, "none", torch.float32),
    ("moe", MOE, "selective", torch.float32),
    ("moe", MOE, "full", torch.float32),
    ("mixtral", MIXTRAL, "full", torch.float32),
    ("dense", DENSE, "none", torch.bfloat16),
    ("moe", MOE, "full", torch.bfloat16),
]


class PeakTracker(TorchDispatchMode):
    """Live bytes of every storage an op returns inside the block (plus ``preexisting``), freed
    when the storage dies (a weakref finalizer on the storage, which PyTorch keeps as one Python
    object while it lives); views share their base's storage and count once."""

    def __init__(self, preexisting=()):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0
        for t in preexisting:
            self._see(t)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def _see(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.now += self.live[key]
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._see(t)
        return out


def _row(lengths, vocab: int, gen: torch.Generator) -> MicroBatch:
    """Packed documents of random tokens, every position but a document's last a target."""
    ids = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:-1] = ids[1:]
    labels[torch.tensor(lengths).cumsum(0) - 1] = IGNORE_INDEX
    pos = torch.cat([torch.arange(n) for n in lengths])
    return MicroBatch(ids, pos, labels, torch.tensor([0, *lengths]).cumsum(0).to(torch.int32))


def _measure(cfg: dict, recompute: str, dtype: torch.dtype):
    """Peak bytes of a steady-state step: optimizer state exists (a first step ran), gradients
    start as None and two micro-batches accumulate into them, a short one (it creates every
    gradient) then the long one, so the long one's backward runs with all gradients resident
    (as every micro-batch after the first of a step does)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(**cfg), {}, vocab_needed=0).to(dtype)
    model.runtime.checkpoint = recompute
    opt = build_optimizer(model, OptimConfig())
    gen = torch.Generator().manual_seed(0)
    short, long = _row([8, 8], cfg["vocab_size"], gen), _row(DOCS[dtype], cfg["vocab_size"], gen)

    def forward_backward(mb):
        parts = model(mb)
        loss = parts.ce_sum / mb.num_target_tokens
        if parts.aux_loss is not None:
            loss = loss + parts.aux_loss
        loss.backward()

    forward_backward(short)
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    batches = [t for mb in (short, long) for t in (mb.input_ids, mb.position_ids, mb.labels, mb.cu_seqlens)]
    with PeakTracker(params + list(model.buffers()) + state + batches) as tracker:
        before = tracker.now
        forward_backward(short)
        forward_backward(long)
        opt.step()
        opt.zero_grad(set_to_none=True)
    moments = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    sizes = dict(params=sum(p.numel() * p.element_size() for p in params),
                 optimizer=sum(v.numel() * v.element_size() for v in moments))  # not the step counters
    return tracker.peak, before, sizes, long


def _predict(cfg: dict, recompute: str, dtype: torch.dtype, mb: MicroBatch) -> memory.MemoryBreakdown:
    spec = model_spec(ModelConfig(**cfg), {})
    b = torch.tensor([], dtype=dtype).element_size()
    layers = range(spec.num_layers)
    # The masters are in the compute dtype here (no autocast); AdamW keeps two moments in it.
    out = memory.static_memory(spec, layers, True, True, master_bytes=b, compute_bytes=b, grad_bytes=b,
                               optimizer_bytes_per_param=2 * b)
    kw = dict(recompute=recompute, element_bytes=b, attention="sdpa", master_bytes=b)
    out.activations = memory.llm_activation_bytes(spec, layers, mb.num_tokens, first=True, last=True, **kw)
    out.transient = max(memory.head_transient_bytes(spec, mb.num_target_tokens, element_bytes=b),
                        memory.layer_transient_bytes(spec, layers, mb.num_tokens, **kw))
    return out


@pytest.mark.parametrize("name,cfg,recompute,dtype", CASES,
                         ids=[f"{c[0]}-{c[2]}-{str(c[3]).split('.')[-1]}" for c in CASES])
def test_predicted_peak_matches_measured_step(name, cfg, recompute, dtype):
    measured, before, sizes, mb = _measure(cfg, recompute, dtype)
    pred = _predict(cfg, recompute, dtype, mb)
    err = (pred.total - measured) / measured
    print(f"\n{name:15s} {recompute:9s} {str(dtype).split('.')[-1]:8s} measured {measured / MIB:7.2f} MiB  "
          f"predicted {pred.total / MIB:7.2f} MiB  error {err:+.1%}  "
          f"(static {(pred.params + pred.grads + pred.optimizer) / MIB:.2f}, activations "
          f"{pred.activations / MIB:.2f}, transient {pred.transient / MIB:.2f})")
    # The tracker must see what surely exists: weights, optimizer state, and the gradients,
    # which are created inside the measured step.
    grads = sizes["params"]
    assert measured >= sizes["params"] + grads + sizes["optimizer"]
    assert measured - before >= grads
    assert pred.params == pytest.approx(sizes["params"]) and pred.optimizer == pytest.approx(sizes["optimizer"])
    assert abs(err) <= TOLERANCE, (name, recompute, dtype, measured, pred.gib())


def test_tracker_counts_storages_once_and_sees_frees():
    with PeakTracker() as tracker:
        a = torch.empty(1000)  # 4000 bytes
        view = a[10:].view(-1, 10)  # same storage: nothing more
        b = a + 1  # 8000 alive
        del a, view, b
        c = torch.empty(500)  # 2000 alive
    assert tracker.peak == 8000
    assert tracker.now == 2000
    del c


@pytest.mark.parametrize("tp,ep,shard", [(1, 1, 1), (2, 2, 4)])
def test_static_parameters_follow_the_layout(tp, ep, shard):
    """Parameter bytes per GPU as the runtime places them (omni/runtime/parallelize.py): TP
    splits attention, the dense MLP and the vocabulary; FSDP shards all of that and the norms;
    MoE router and shared expert are neither TP-split nor FSDP-sharded, experts split by EP."""
    cfg = ModelConfig(**MOE, mlp_only_layers=[0])  # one dense block among the MoE ones
    with torch.device("meta"):
        model = build_model(cfg, {}, vocab_needed=0)
    split = replicated = moe_shared = experts = 0
    for name, p in model.llm.named_parameters():
        if ".experts." in name:
            experts += p.numel()
        elif ".mlp." in name and model.llm.layers[int(name.split(".")[1])].is_moe:
            moe_shared += p.numel()
        elif "norm" in name:
            replicated += p.numel()
        else:
            split += p.numel()
    expected = ((split / tp + replicated) / shard + moe_shared + experts / ep) * 4
    spec = model_spec(cfg, {})
    got = memory.static_memory(spec, range(spec.num_layers), True, True, tp=tp, ep=ep, shard=shard)
    assert got.params == pytest.approx(expected)
    assert got.optimizer == pytest.approx(expected * 2)
    # bf16 compute from fp32 masters: one shared bf16 copy of this GPU's experts (and of the
    # router and shared expert), whatever the number of micro-batches in flight
    moe_copy = (moe_shared + experts / ep) * 2
    assert got.gathered >= moe_copy
    if shard > 1:
        window = sorted(((p.split / tp + p.norms) for p in (memory._layer_params(spec, i)
                                                             for i in range(spec.num_layers))), reverse=True)[:2]
        root = (spec.embed_params + spec.head_params) / tp + spec.norm_params
        assert got.gathered == pytest.approx((sum(window) + root) * 2 + moe_copy)


@pytest.mark.parametrize("freeze", [False, True])
def test_encoder_static_memory_counts_what_trains(freeze):
    """A frozen encoder has no gradients or optimizer state; its projector still trains."""
    from omni.models.config import EncoderSlot

    slots = {"vision": EncoderSlot(name="siglip", freeze=freeze, params=dict(
        hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, image_size=64,
        patch_size=8, max_patches=64))}
    cfg = ModelConfig(**DENSE)
    with torch.device("meta"):
        model = build_model(cfg, slots, vocab_needed=0)
    mods = (model.encoders["image"], model.projectors["image"])
    total = sum(p.numel() for m in mods for p in m.parameters())
    trained = sum(p.numel() for m in mods for p in m.parameters() if p.requires_grad)
    assert (trained < total) == freeze
    got = memory.encoder_static_memory(model_spec(cfg, slots), "image")
    assert got.params == total * 4
    assert got.grads == trained * 4 and got.optimizer == trained * 8


def test_optimizer_step_peak_with_foreach_adamw():
    """CUDA's AdamW runs foreach (one sqrt(v) temporary per parameter group, all at once); run
    the same here and measure the step alone, every gradient present."""
    torch.manual_seed(0)
    cfg = ModelConfig(**DENSE)
    model = build_model(cfg, {}, vocab_needed=0)
    opt = build_optimizer(model, OptimConfig())
    for group in opt.param_groups:
        group["foreach"] = True
    mb = _row([8, 8], DENSE["vocab_size"], torch.Generator().manual_seed(0))
    for _ in range(2):  # the first step creates the state
        opt.zero_grad(set_to_none=True)
        model(mb).ce_sum.backward()
        if not opt.state:
            opt.step()
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values()]
    with PeakTracker(params + [p.grad for p in params] + state) as tracker:
        opt.step()
    spec = model_spec(cfg, {})
    static = memory.static_memory(spec, range(spec.num_layers), True, True, compute_bytes=4)
    pred = static.params + static.grads + static.optimizer + memory.optimizer_step_transient_bytes(static)
    err = (pred - tracker.peak) / tracker.peak
    print(f"\noptimizer step  measured {tracker.peak / MIB:.2f} MiB  predicted {pred / MIB:.2f} MiB  error {err:+.1%}")
    assert abs(err) <= TOLERANCE


def _cp_rank(rank: int, world: int) -> None:
    """One CP rank of ``test_context_parallel_activations_follow_the_model``."""
    import torch.distributed as dist

    from dataloading.construct.context_parallel import slice_for_cp

    for impl, kernel in (("ring", "varlen"), ("ulysses", "sdpa")):
        torch.manual_seed(0)
        model = build_model(ModelConfig(**DENSE), {}, vocab_needed=0)
        rt = model.runtime
        rt.cp_group, rt.cp_size, rt.cp_impl = dist.group.WORLD, world, impl
        gen = torch.Generator().manual_seed(0)
        short, long = (slice_for_cp(_row(lens, DENSE["vocab_size"], gen), world, rank, pad_id=0)
                       for lens in ([8, 8], DOCS[torch.float32]))
        params = list(model.parameters())
        forward_backward = lambda mb: model(mb).ce_sum.backward()  # noqa: E731
        forward_backward(short)  # creates every gradient
        batches = [t for mb in (short, long) for t in (mb.input_ids, mb.position_ids, mb.labels, mb.cu_seqlens)]
        with PeakTracker(params + list(model.buffers()) + [p.grad for p in params] + batches) as tracker:
            forward_backward(long)
        spec = model_spec(ModelConfig(**DENSE), {})
        layers = range(spec.num_layers)
        static = memory.static_memory(spec, layers, True, True, master_bytes=4, compute_bytes=4, grad_bytes=4,
                                      optimizer_bytes_per_param=0)
        kw = dict(element_bytes=4, attention=kernel, master_bytes=4)
        predicted = (static.total + memory.llm_activation_bytes(spec, layers, long.num_tokens, first=True, last=True, **kw)
                     + max(memory.head_transient_bytes(spec, long.num_target_tokens, element_bytes=4),
                           memory.layer_transient_bytes(spec, layers, long.num_tokens, ring=impl == "ring", **kw)))
        err = (predicted - tracker.peak) / tracker.peak
        print(f"\ncp={world} {impl} rank {rank}: measured {tracker.peak / MIB:.2f} MiB, predicted "
              f"{predicted / MIB:.2f} MiB, error {err:+.1%}")
        assert abs(err) <= TOLERANCE, (impl, rank, tracker.peak, predicted)


def test_context_parallel_activations_follow_the_model():
    """Under cp = 2 a rank keeps the activations of its own tokens only: ring attention keeps what
    the varlen kernels keep (q, k, v, the output, one log-sum-exp per query and head), Ulysses
    what the PyTorch varlen path keeps over the whole row's heads it owns. The same memory model
    as one process, at the rank's token count, within the same tolerance (a score matrix kept
    per ring hop, as before issue 38, measured 114 MiB here: 39% over)."""
    from tests.parallel.dist_helpers import run_ranks

    run_ranks(_cp_rank, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_transient_follows_the_chunked_loss(dtype):
    """The loss's extra peak (head_transient_bytes) against the measured peak of the chunked head
    and cross-entropy (parallel/linear_cross_entropy.py), forward and backward, at a vocabulary
    whose logits take two chunks. (That no targets x vocab buffer is saved is
    tests/parallel/test_linear_cross_entropy.py's; scripts/bench/loss_memory.py measures 8k x 152k.)"""
    from parallel.linear_cross_entropy import linear_cross_entropy
    from parallel.sizing import LOSS_CHUNK_BYTES

    vocab, hidden_size = 24_000, 64
    rows = LOSS_CHUNK_BYTES // (4 * vocab)
    n = rows + rows // 3  # two chunks
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, hidden_size, generator=gen) * 0.1).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.1).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    with PeakTracker([hidden, weight, labels]) as tracker:
        before = tracker.now
        linear_cross_entropy(hidden, weight, labels).backward()
    # what stays: the two gradients (hidden's, and the head's: a parameter's, counted in the
    # static part of the model) and the 0-dim loss
    measured = tracker.peak - before
    spec = model_spec(ModelConfig(family="llama", vocab_size=vocab, hidden_size=hidden_size, intermediate_size=64,
                                  num_layers=1, num_heads=2, num_kv_heads=1), {})
    e = torch.tensor([], dtype=dtype).element_size()
    predicted = memory.head_transient_bytes(spec, n, element_bytes=e)
    err = (predicted - measured) / measured
    print(f"\nloss {dtype}: {n} targets x {vocab}: measured {measured / MIB:.1f} MiB, predicted "
          f"{predicted / MIB:.1f} MiB ({err:+.1%})")
    assert abs(err) <= TOLERANCE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU check runs it)")
@pytest.mark.parametrize("name,cfg,recompute", [("dense", DENSE, "none"), ("moe", MOE, "full")])
def test_cuda_peak_matches_the_memory_model(name, cfg, recompute):
    """On a GPU: torch.cuda.max_memory_allocated of a bf16 step (the varlen kernels' attention)
    against the same prediction the simulator composes, within the same 10%."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(**cfg), {}, vocab_needed=0).to("cuda", torch.bfloat16)
    model.runtime.checkpoint = recompute
    opt = build_optimizer(model, OptimConfig())
    gen = torch.Generator().manual_seed(0)
    rows = [_row(lengths, cfg["vocab_size"], gen) for lengths in ([8, 8], [600, 560, 500, 388])]
    rows = [MicroBatch(mb.input_ids.cuda(), mb.position_ids.cuda(), mb.labels.cuda(), mb.cu_seqlens.cuda())
            for mb in rows]

    def forward_backward(mb):
        parts = model(mb)
        loss = parts.ce_sum / int((mb.labels != IGNORE_INDEX).sum())
        (loss if parts.aux_loss is None else loss + parts.aux_loss).backward()

    forward_backward(rows[0])
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    # What is allocated now beyond the weights and the optimizer state (cuBLAS workspaces, kept by
    # the caching allocator) is a constant the model does not price: leave it out of the peak.
    held = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    extra = torch.cuda.memory_allocated() - held
    torch.cuda.reset_peak_memory_stats()
    for mb in rows:
        forward_backward(mb)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - max(extra, 0)
    spec = model_spec(ModelConfig(**cfg), {})
    layers = range(spec.num_layers)
    pred = memory.static_memory(spec, layers, True, True, master_bytes=2, compute_bytes=2, grad_bytes=2,
                                optimizer_bytes_per_param=4)
    tokens = rows[1].input_ids.numel()
    kw = dict(recompute=recompute, element_bytes=2, attention="varlen", master_bytes=2)
    pred.activations = memory.llm_activation_bytes(spec, layers, tokens, first=True, last=True, **kw)
    pred.transient = max(memory.head_transient_bytes(spec, tokens, element_bytes=2),
                         memory.layer_transient_bytes(spec, layers, tokens, **kw))
    err = (pred.total - measured) / measured
    print(f"\ncuda {name} {recompute}: measured {measured / MIB:.2f} MiB, predicted {pred.total / MIB:.2f} MiB "
          f"({err:+.1%})")
    assert abs(err) <= TOLERANCE, (measured, pred.gib())
