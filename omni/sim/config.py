"""Knobs of ``omni simulate`` and ``omni plan``: the cluster (``cluster`` group, presets in
``conf/cluster/``), the simulated data (``data``) and the simulator's own options (``sim``).

The model, encoders, parallel and multiplex groups are the training config's own, so a layout
the simulator likes is a layout ``omni train`` accepts unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omni.run_config import ModelOnLayout

# megatron: Megatron-LM as its users run it (encoders inside stage 0; its layout searched, packing
# largest first, TP communication overlapped); megatron_naive: a default Megatron-LM held to the
# workload's layout with next-fit packing. See omni/sim/megatron.py.
PLACEMENTS = ("colocated", "stage0", "encoder_first", "disaggregated", "megatron", "megatron_naive")


@dataclass
class ClusterConfig:
    """One kind of GPU and how the GPUs are wired. Bandwidths in GB/s (1e9 bytes), one
    direction, per GPU. The defaults are the h100 preset's (``conf/cluster/h100.yaml``); the
    sources of the efficiencies are tabled in docs/benchmarks.md (link calibration)."""

    name: str = "h100"
    num_gpus: int = 64
    gpus_per_node: int = 8
    peak_tflops: float = 989.0  # dense bf16 tensor-core peak, TFLOP/s
    hbm_gib: float = 80.0
    hbm_gbps: float = 3350.0
    nvlink_gbps: float = 450.0  # inside a node
    nvlink_latency_us: float = 5.0  # per ring step over NVLink
    # Between nodes: NICs per node and each NIC's bandwidth. DGX/HGX H100: eight 400 Gb/s NICs,
    # one per GPU. A GPU's share of its node's NICs is net_gbps * nics_per_node / gpus_per_node
    # (rail-optimised: a GPU sends over the NIC next to it, and the NICs of a node serve every
    # group at once); a collective whose group has m GPUs in a node leaves it over m such shares.
    nics_per_node: int = 8
    net_gbps: float = 50.0  # one NIC, GB/s one way
    net_latency_us: float = 15.0  # per ring step that crosses nodes
    # GPU <-> host memory, one direction, per GPU (activation offloading's copies): PCIe 5.0 x16
    # carries 63 GB/s on the wire (32 GT/s x 16 lanes, 128b/130b coding); 50 assumes pinned copies
    # reach ~80% of it (an assumption: scripts/gpu_check.sh measures it where a GPU is lent).
    host_gbps: float = 50.0
    # Fractions of the line rates NCCL's own traffic reaches, one per link, since published
    # figures put NVLink and the NICs at different fractions. NVLink: 370 of 450 GB/s, the
    # effective rate NVIDIA gives for rings and every collective but NVLS all-reduce on H100
    # (https://github.com/NVIDIA/nccl-tests/issues/212; 365-370 GB/s ring all-reduce busbw on 2
    # to 8 GPUs, https://github.com/NVIDIA/nccl/issues/1455). NICs: 47.5 of 50 GB/s, the middle
    # of NVIDIA's 46-48 and 48-49 GB/s per 400 Gb/s NDR NIC
    # (https://github.com/NVIDIA/nccl-tests/issues/290, https://github.com/NVIDIA/nccl-tests/issues/267).
    nvlink_efficiency: float = 0.822
    net_efficiency: float = 0.95
    # NVLink SHARP (NVLS): the NVSwitch reduces an all-reduce inside a node (third-generation
    # NVSwitch, Hopper and later; not A100). Each GPU then moves (n+1)/n of the tensor each way
    # (NVIDIA: algbw = link bandwidth x n/(n+1), https://github.com/NVIDIA/nccl-tests/pull/239)
    # at nvls_efficiency of the NVLink line rate: 309 of 450 GB/s, from NVIDIA's ~275 GB/s
    # algbw at 8 GPUs (275 x 9/8; nccl-tests issue 212 above); NCCL's tuner charges it one
    # latency, 23-25 us across releases (hwLat NVLink/NVLS/Simple in NCCL's src/graph/tuning.cc).
    nvls: bool = True
    nvls_efficiency: float = 0.6875
    nvls_latency_us: float = 25.0
    # Fractions of the compute peaks real kernels reach; `omni simulate --calibrate TRACE` fits them.
    # GEMM: 792.1 of 989 TFLOP/s, the best bf16 matmul measured on an H100 SXM (maximum achievable
    # matmul FLOPS table, https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md),
    # a ceiling real shapes stay under. Attention: FlashAttention-2 (the kernel omni.kernels calls)
    # runs causal fwd+bwd at 327.9 TFLOP/s on an H100 (head dim 128, 8192 tokens; Azure ND H100
    # v5, https://github.com/Azure/AI-benchmarking-guide/blob/main/Azure%20Results/ND_H100_v5_results.md),
    # counting the backward as 2.5 forwards; this model's backward is 2 forwards at the same
    # efficiency, so the same time is 3 / 3.5 x 327.9 / 989 (shorter documents run slower, so
    # this too is a ceiling). scripts/bench/mfu.py's measured
    # matmul peak replaces the GEMM figure once a GPU run is recorded in docs/benchmarks.md.
    gemm_efficiency: float = 0.8
    attention_efficiency: float = 0.284
    memory_efficiency: float = 0.75
    # One factor on both links' efficiencies: 1 takes the published figures above as they are;
    # `omni simulate --calibrate` fits it from a measured run's gradient syncs.
    comm_efficiency: float = 1.0
    # Encoder kernels relative to the backbone's (smaller, differently shaped GEMMs): a factor on
    # the encoders' compute efficiency, 1 by default; --calibrate fits it apart.
    encoder_efficiency: float = 1.0
    # Fixed time per kernel-sized op (launch, synchronisation), microseconds.
    op_overhead_us: float = 8.0
    # Memory a GPU cannot give to tensors (CUDA context, NCCL buffers, fragmentation), GiB.
    memory_reserve_gib: float = 5.0


@dataclass
class SimDataConfig:
    """The mixture a simulated step draws. ``source=lengths``: samples from the distributions
    below; ``source=mixture``: the samples of a real mixture YAML, drawn by the data plane's
    planner from its index (lengths only: no shard is opened)."""

    source: str = "lengths"
    mixture: Optional[str] = None
    tokenizer: str = "byte"  # source=mixture: as training's data.tokenizer
    # Samples per optimizer step and the packing budget, as in training's `data` group.
    global_batch_size: int = 256
    micro_batch_tokens: int = 16384
    # LLM tokens of a text-only sample: log-normal around the mean (sigma 0: fixed). The same
    # sigma spreads the text around a media sample's items.
    sample_tokens: int = 2048
    sample_tokens_sigma: float = 0.5
    # Share of the step's LLM tokens that come from encoders (media), in expectation over the
    # batch: 0.9 is a 9:1 media:text mix. Set by the share of text-only samples (and, beyond what
    # an all-media batch carries, by shortening the text around the media); 0: no media.
    image_ratio: float = 0.5
    # Dynamic workload: [[fraction_of_run, ratio], ...], linearly interpolated; the simulated
    # steps sit at fractions (i + 0.5) / steps of the run, each drawn at its own ratio (then
    # image_ratio is not used). None: every step at image_ratio.
    image_ratio_schedule: Optional[List[Any]] = None  # pairs; checked by omni.sim.data.check_schedule
    # What a media sample holds, kind -> weight (renormalised over the kinds whose encoder the
    # model has; 0 leaves a kind out): image (one image), multi_image (images_per_sample images),
    # video (one clip of video_frames frames, each an image item: the ViT encodes frames) and
    # audio (one clip; needs an audio encoder).
    media_mix: Dict[str, float] = field(default_factory=lambda: {
        "image": 0.5, "multi_image": 0.25, "video": 0.15, "audio": 0.1})
    # Encoder tokens per image (image, multi_image), log-uniform in [min, max] (dynamic resolution).
    image_tokens_min: int = 256
    image_tokens_max: int = 2048
    images_per_sample: List[int] = field(default_factory=lambda: [2, 6])  # multi_image, uniform [lo, hi]
    video_frames: List[int] = field(default_factory=lambda: [8, 32])  # frames per clip, uniform [lo, hi]
    frame_tokens: List[int] = field(default_factory=lambda: [144, 256])  # per frame, log-uniform, one size a clip
    audio_tokens: List[int] = field(default_factory=lambda: [250, 1500])  # per clip, log-uniform
    # Mean text tokens around a media sample's items (prompt, caption, answer), log-normal.
    media_text_tokens: int = 256
    # The encoder settings the sizes above assume, slot -> {param: value} (a workload's ViT:
    # its spatial merge and patch budget). Each goes to encoders.<slot>.params where the slot's
    # tower has that param and the command line does not set it; where the tower has no such
    # param it is skipped with one line, and the tower sizes the media in its own terms
    # (EncoderAnchor.simulated_item / simulated_clip: an image of n patches is what its
    # processor makes of n of its patches, e.g. anyres tiles or one fixed square).
    encoder_params: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    # How the planner arranges a step over DP ranks and micro-batches (data.balance in training).
    balance: str = "balanced"
    # source=mixture: as training's data.over_budget (error, truncate, split, skip).
    over_budget: str = "error"
    # Steps simulated (figures are their mean), the first one, and the draw's seed (source=mixture:
    # training's trainer.seed, so the simulated steps are the ones training draws).
    steps: int = 3
    first_step: int = 0
    seed: int = 0
    # source=mixture: the run's length in planner steps; the simulated steps are spread over
    # first_step .. first_step + run_steps (the mixture's curriculum applies at each). 0: the
    # steps first_step .. first_step + steps - 1.
    run_steps: int = 0


@dataclass
class SimOptions:
    placements: List[str] = field(default_factory=lambda: list(PLACEMENTS))
    # disaggregated: GPUs that only run encoders, in whole LLM model-parallel groups; the LLM
    # keeps its layout on the rest, with fewer DP ranks. 0: chosen for the run, the pool size
    # (up to half the cluster) whose simulated steps are fastest on average over every
    # simulated step (a ratio schedule's too): one pool for the whole run, as a real
    # disaggregated deployment has.
    encoder_gpus: int = 0
    # colocated and stage0: run with the multiplex.chunks_per_cut chosen for the run (the
    # fastest of 1, 2, 4, ... up to one call per step whose every simulated step fits in memory;
    # the JSON's chunks_per_cut_search lists each), instead of the configured one. Training
    # takes the chosen number as its multiplex.chunks_per_cut.
    chunks_per_cut_search: bool = False
    # Bytes per parameter element of the optimizer state (AdamW: two fp32 moments).
    optimizer_bytes_per_param: int = 8
    # The efficiency factors fitted by `omni simulate --calibrate` (a YAML); None: the preset's.
    calibration: Optional[str] = None
    # omni plan: layouts kept in the printout.
    top_k: int = 5
    # omni simulate: placements whose layout is searched (as omni plan searches, the fastest that
    # fits) before they are compared, instead of run on the configured one. The tuned Megatron
    # baseline is searched as its users tune it (omni.sim.search.megatron_candidates).
    search_layouts: List[str] = field(default_factory=lambda: ["megatron"])
    # Megatron placements: LLM layers on the first pipeline stage, the rest split evenly over the
    # others (Megatron-LM's --decoder-first-pipeline-num-layers); 0: an even split. Set by the search.
    first_stage_layers: int = 0


@dataclass
class SimConfig(ModelOnLayout):
    name: str = "simulate"
    data: SimDataConfig = field(default_factory=SimDataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    sim: SimOptions = field(default_factory=SimOptions)
