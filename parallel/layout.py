"""The process layout: one object that says which rank does what, passed around explicitly
(no global state).

The world is a 5D grid ``pp x dp_replicate x dp_shard x cp x tp``, TP innermost and PP
outermost: consecutive ranks (one node) share the chattiest groups — TP talks every layer,
CP every attention, DP once per step, PP only at stage boundaries. Expert parallelism is
borrowed from ``dp_shard x cp`` (its innermost part): EP ranks hold different experts but still
count as data-parallel ranks for everything else, as in torchtitan.

Groups are built once here, by every rank in the same order, and handed to the mechanisms
that need them (FSDP meshes, TP mesh, CP/EP/PP process groups).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.config import ParallelConfig
from parallel.device_rules import DeviceRules, resolve_device_rules
from parallel.sizing import (  # noqa: F401  (re-exported: the pure sizing lives there)
    CHECKPOINT_MODES, CP_IMPLS, DIMS, EXPERT_MESH_DIMS, MESH_DIMS, PP_SCHEDULES, PRECISIONS, RESHARD_CHOICES,
    LayoutError, Sizes, _check_nodes, all_coords, check_model_fits, check_options, check_sequence, describe,
    resolve_sizes)

@dataclass(frozen=True, eq=False)
class Layout:
    """This rank's place in the world and the groups it talks through."""

    world_size: int
    rank: int
    device: torch.device
    sizes: Sizes = field(default_factory=Sizes)
    config: ParallelConfig = field(default_factory=ParallelConfig)
    # DTensor meshes. dp_shard and cp are one mesh dimension here (FSDP shards over both); the CP
    # group itself is in ``groups``. Same rank order as DIMS.
    mesh: DeviceMesh | None = None  # dims MESH_DIMS
    expert_mesh: DeviceMesh | None = None  # dims EXPERT_MESH_DIMS: dp_shard x cp split as (outer, ep)
    groups: dict = field(default_factory=dict)  # name -> ProcessGroup (see _build_groups)
    # How long any collective waits for its peers (parallel.timeout_s); groups created later
    # (pipeline, encoder SP, host) take it through ``new_group``.
    timeout: timedelta = timedelta(seconds=600)
    # Whose rules the device-dependent decisions follow (trainer.device_rules; None: the
    # device's own, filled in at construction).
    rules: DeviceRules | None = None

    def __post_init__(self):
        if self.rules is None:
            object.__setattr__(self, "rules", resolve_device_rules("auto", self.device))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def coords(self) -> dict[str, int]:
        return self.sizes.coords(self.rank)

    @property
    def dp_size(self) -> int:
        return self.sizes.dp

    @property
    def dp_rank(self) -> int:
        return self.sizes.dp_group(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def ep_rank(self) -> int:
        c = self.coords
        return (c["dp_shard"] * self.sizes.cp + c["cp"]) % self.sizes.ep

    @property
    def counts_data(self) -> bool:
        """Whether this rank counts its tokens in global totals: TP and PP peers hold the same
        tokens, so only the first stage's TP rank 0 of each (dp, cp) position does."""
        c = self.coords
        return c["pp"] == 0 and c["tp"] == 0

    @property
    def stage_world(self) -> int:
        """Ranks that hold the same pipeline stage."""
        return self.world_size // self.sizes.pp

    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP shards over dp_shard x cp (CP ranks hold different tokens, like DP ranks) and
        replicates over dp_replicate (HSDP) when that is > 1."""
        if self.sizes.dp_replicate == 1:
            return self.mesh["dp_shard_cp"]
        return self.mesh["dp_replicate", "dp_shard_cp"]

    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    def ep_mesh(self) -> DeviceMesh:
        if self.sizes.ep == 1:
            raise ValueError("no expert-parallel mesh: parallel.ep=1")
        return self.expert_mesh["ep"]

    def group(self, name: str) -> dist.ProcessGroup:
        return self.groups[name]

    @property
    def peer_source(self) -> int:
        """The rank that loads data for this rank's TP/CP/PP peers (their lowest rank)."""
        c = self.coords
        return self.sizes.rank_of(pp=0, dp_replicate=c["dp_replicate"], dp_shard=c["dp_shard"], cp=0, tp=0)


def _partition_groups(world: int, key: Callable[[int], tuple]) -> list[list[int]]:
    parts: dict[tuple, list[int]] = {}
    for r in range(world):
        parts.setdefault(key(r), []).append(r)
    return list(parts.values())


def new_group(ranks: list[int] | None, timeout: timedelta | None, backend: str | None = None) -> dist.ProcessGroup:
    """``dist.new_group`` with the layout's timeout: torch gives subgroups its own default
    (30 minutes for gloo, 10 for nccl), not the world group's."""
    return dist.new_group(ranks, backend=backend, timeout=timeout)


def _mesh_options(ndim: int, timeout: timedelta) -> dict | None:
    """``init_device_mesh`` overrides that give every mesh dimension's groups ``timeout`` (the
    mesh passes a timeout on only through backend options), on the world group's backend."""
    backend = dist.get_backend()
    kind = {"nccl": getattr(dist, "ProcessGroupNCCL", None), "gloo": dist.ProcessGroupGloo}.get(backend)
    if kind is None:
        return None
    options = kind.Options() if backend == "nccl" else kind._Options()
    options._timeout = timeout
    return {d: (backend, options) for d in range(ndim)}


def _peers_key(sizes: Sizes) -> Callable[[int], tuple]:
    """Ranks that consume the same samples: one (dp_replicate, dp_shard) position."""
    return lambda r: (sizes.coords(r)["dp_replicate"], sizes.coords(r)["dp_shard"])


def _build_groups(sizes: Sizes, rank: int, backend: str | None,
                  timeout: timedelta) -> dict[str, dist.ProcessGroup]:
    """Groups that are not one mesh dimension. Every rank creates every group, same order."""
    coords = sizes.coords
    world = sizes.world

    def ep_key(r):
        c = coords(r)
        flat = c["dp_shard"] * sizes.cp + c["cp"]
        return c["pp"], c["dp_replicate"], c["tp"], flat // sizes.ep

    def expert_replica_key(r):  # ranks that hold the same experts (same ep rank in a stage)
        c = coords(r)
        return c["pp"], (c["dp_shard"] * sizes.cp + c["cp"]) % sizes.ep

    specs = {
        "ep": ep_key,
        "cp": lambda r: (coords(r)["pp"], coords(r)["dp_replicate"], coords(r)["dp_shard"], coords(r)["tp"]),
        # A tied embedding lives on the first and the last pipeline stage: those pairs sum its gradient.
        "tie": lambda r: (coords(r)["dp_replicate"], coords(r)["dp_shard"], coords(r)["cp"], coords(r)["tp"],
                          "ends" if coords(r)["pp"] in (0, sizes.pp - 1) else coords(r)["pp"]),
        "expert_replicas": expert_replica_key,
        # Ranks holding different tokens of the same micro-batch: CP chunks x TP sequence shards.
        "token": lambda r: (coords(r)["pp"], coords(r)["dp_replicate"], coords(r)["dp_shard"]),
        # Ranks of one pipeline stage (every rank of the stage's model replica set).
        "stage": lambda r: (coords(r)["pp"],),
        # Ranks that consume the same samples (one loader, broadcast to the rest).
        "peers": _peers_key(sizes),
    }
    out = {}
    for name, key in specs.items():
        for members in _partition_groups(world, key):
            g = new_group(members, timeout, backend) if world > 1 else dist.group.WORLD
            if rank in members:
                out[name] = g
    return out


def _host_peers_group(sizes: Sizes, rank: int, timeout: timedelta, peers: dist.ProcessGroup,
                      own: bool = False) -> dist.ProcessGroup:
    """The "peers" group (ranks that consume the same samples) over gloo, for the step's host
    objects (omni/runtime/data_feed.py); the peers group itself when the world already is gloo
    (``own``: a group of its own all the same, as on NCCL). Every rank creates every group,
    same order."""
    if sizes.world == 1 or (dist.get_backend() == "gloo" and not own):
        return peers
    mine = peers
    for members in _partition_groups(sizes.world, _peers_key(sizes)):
        g = new_group(members, timeout, "gloo")
        if rank in members:
            mine = g
    return mine


def _pick_device() -> torch.device:
    """This process's GPU: ``LOCAL_RANK`` (torchrun sets it). A multi-process launch on CUDA
    without it is refused rather than piling every rank onto GPU 0."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise LayoutError("WORLD_SIZE > 1 but LOCAL_RANK is not set, so this rank cannot tell which GPU is "
                              "its own; launch with torchrun (it sets LOCAL_RANK) or set LOCAL_RANK per process")
        local = "0"
    index = int(local)
    if not 0 <= index < torch.cuda.device_count():
        raise LayoutError(f"LOCAL_RANK={index} but this node has {torch.cuda.device_count()} GPU(s); launch at "
                          f"most that many processes per node (torchrun --nproc-per-node)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _restart_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun's agent store, a store private to this restart attempt; None elsewhere
    (``init_process_group`` then reads MASTER_ADDR/MASTER_PORT itself).

    torchrun (the elastic agent) keeps one store across ``--max-restarts`` attempts, with the
    previous attempt's keys still in it: a restarted gloo group reads a dead peer's address
    and fails to connect ("connectFullMesh failed ... Connection refused"). A prefix per
    attempt gives every attempt fresh keys.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"omni/attempt_{attempt}", store)


def launched_world_size() -> int:
    """The ranks this job runs on, before any process group exists: torchrun's WORLD_SIZE, or 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1


def init_layout(cfg: ParallelConfig, device: str = "auto", device_rules: str = "auto", precision: str = "auto",
                device_memory_gib: float | None = None) -> Layout:
    """Join (or create) the process group, check the sizes and build the mesh and groups.
    ``device_rules``, ``precision``, ``device_memory_gib``: ``trainer.device_rules``,
    ``trainer.precision``, ``trainer.device_memory_gib`` (``parallel.device_rules``).

    A single process still gets a real (world size 1) gloo group, so checkpointing and
    collectives take the same code path as a multi-rank launch.
    """
    dev = _pick_device() if device == "auto" else torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # device_id and the meshes need the index
        dev = torch.device("cuda", torch.cuda.current_device())
    rules = resolve_device_rules(device_rules, dev, precision, device_memory_gib)  # before any process group
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
    check_options(cfg)  # before any process group: a bad timeout would otherwise reach init_process_group
    timeout = timedelta(seconds=cfg.timeout_s)
    if not dist.is_initialized():
        # On CUDA the world group is bound to this rank's GPU: NCCL then connects eagerly and
        # never guesses the device from the current one.
        bound = {"device_id": dev} if dev.type == "cuda" else {}
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            store = _restart_store(timeout)
            where = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                              "world_size": int(os.environ["WORLD_SIZE"])}
            dist.init_process_group(backend=backend, timeout=timeout, **where, **bound)
        else:
            store = dist.HashStore()
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout, **bound)
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = resolve_sizes(cfg, world)
    shard_cp = sizes.dp_shard * sizes.cp
    mesh = init_device_mesh(dev.type, (sizes.pp, sizes.dp_replicate, shard_cp, sizes.tp), mesh_dim_names=MESH_DIMS,
                            backend_override=_mesh_options(len(MESH_DIMS), timeout))
    expert_mesh = mesh if sizes.ep == 1 else init_device_mesh(
        dev.type, (sizes.pp, sizes.dp_replicate, shard_cp // sizes.ep, sizes.ep, sizes.tp),
        mesh_dim_names=EXPERT_MESH_DIMS, backend_override=_mesh_options(len(EXPERT_MESH_DIMS), timeout))
    groups = _build_groups(sizes, rank, None, timeout)
    groups["peers_host"] = _host_peers_group(sizes, rank, timeout, groups["peers"], own=rules.cuda)
    return Layout(world_size=world, rank=rank, device=dev, sizes=sizes, config=cfg, mesh=mesh,
                  expert_mesh=expert_mesh, groups=groups, timeout=timeout, rules=rules)


def encoder_mesh(layout: Layout, first_stage_only: bool, shard_group: int | None = None) -> DeviceMesh:
    """A 1D mesh (dim "encoder") over the ranks that run encoders: every rank, or with
    ``first_stage_only`` the first pipeline stage's (those ranks get it, the others a mesh
    over their own stage, unused). With ``shard_group``: a 2D mesh (dims "encoder_replicate",
    "encoder_shard") over the same ranks, for HSDP: groups of ``shard_group`` consecutive
    encoder ranks (a node, where the group is one) along "encoder_shard", the groups along
    "encoder_replicate". It creates process groups: every rank calls it, in the same order."""
    dev = layout.device.type
    whole = not first_stage_only or layout.sizes.pp == 1
    ranks = layout.world_size if whole else layout.stage_world
    if shard_group is None:
        shape, names = (ranks,), ("encoder",)
    else:  # a divisor of ``ranks`` (omni.step.multiplex_rules.encoder_shard_group checks it)
        shape, names = (ranks // shard_group, shard_group), ("encoder_replicate", "encoder_shard")
    if whole:
        return init_device_mesh(dev, shape, mesh_dim_names=names,
                                backend_override=_mesh_options(len(shape), layout.timeout))
    mesh = init_device_mesh(dev, (layout.sizes.pp, *shape), mesh_dim_names=("pp", *names),
                            backend_override=_mesh_options(1 + len(shape), layout.timeout))
    return mesh[names[0]] if len(names) == 1 else mesh[names]


def pipeline_gradient_group(layout: Layout) -> dist.ProcessGroup:
    """A second group over this rank's pipeline ranks (same members and order as
    ``mesh["pp"]``), on which the pipeline sends gradients while activations use the first:
    each channel then keeps its own message order between two ranks. Every rank calls it, in
    the same order (it creates process groups)."""
    if layout.world_size == 1:
        return dist.group.WORLD
    coords = layout.sizes.coords
    mine = None
    for members in _partition_groups(layout.world_size, lambda r: tuple(v for d, v in coords(r).items() if d != "pp")):
        g = new_group(members, layout.timeout)
        if layout.rank in members:
            mine = g
    return mine


def host_group(layout: Layout) -> dist.ProcessGroup | None:
    """A group over the world for small host-side objects (plans, metadata): gloo, so that
    exchanging them never touches the accelerator (an object collective over nccl copies
    through the device and synchronises it). None: the default group already is gloo."""
    # Under CUDA's rules on gloo too: the host objects then take their own group, as on NCCL.
    if layout.world_size == 1 or (dist.get_backend() == "gloo" and not layout.rules.cuda):
        return None
    return new_group(None, layout.timeout, backend="gloo")


def barrier() -> None:
    """Wait for every rank (a no-op for a single process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
