"""The link model (omni/sim/machine.py) with the cluster presets (conf/cluster/) against published
nccl-tests and vendor figures for H100, H200 and H800: each row is one published bus bandwidth,
with its source, and the model's figure for the same collective, group and size must be within
15% of it. docs/benchmarks.md tables the same rows (model, published, difference), the rows left
out and why, and what no source was found for.

What a row holds: the nccl-tests collective; the GPUs and nodes (8 GPUs a node); the size
column of nccl-tests (bytes; where the source states none, its figure is a peak and the model is
read at 8 GiB); the published busbw in GB/s. ``ring``: the source measured with NVLink SHARP off
(``NCCL_ALGO=RING`` or ``NCCL_NVLS_ENABLE=0``). ``guidance``: a figure NVIDIA's engineers give as
what a healthy system reaches, not one run's output.

The rows are the bandwidth regime: sizes at which the published curve is within 15% of its own
peak. Below that NCCL's protocol and pipeline ramp (not modelled: one latency term per step) makes
the model optimistic (docs/benchmarks.md gives the numbers)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from omni.sim.config import ClusterConfig
from omni.sim.machine import CommGroup, Machine

REPO = Path(__file__).resolve().parents[2]
GiB = 2 ** 30
MiB = 2 ** 20
TOLERANCE = 0.15

AZURE_H100 = "https://github.com/Azure/AI-benchmarking-guide/blob/main/Azure%20Results/ND_H100_v5_results.md"
AZURE_H200 = "https://github.com/Azure/AI-benchmarking-guide/blob/main/Azure_Results/ND_H200_v5_results.md"
NCCL_1455 = "https://github.com/NVIDIA/nccl/issues/1455"
NCCL_2140 = "https://github.com/NVIDIA/nccl/issues/2140"
TESTS_212 = "https://github.com/NVIDIA/nccl-tests/issues/212"
# alltoall across N nodes of 8, one NIC per GPU: busbw = N/(N-1) x what one NIC carries
# (https://github.com/NVIDIA/nccl-tests/issues/130), 48-49 GB/s per NDR NIC
# (https://github.com/NVIDIA/nccl-tests/issues/267).
TESTS_130_267 = "https://github.com/NVIDIA/nccl-tests/issues/130 + /issues/267"
NDR_NIC = 48.5


@dataclass(frozen=True)
class Published:
    gpu: str  # conf/cluster preset
    kind: str  # nccl-tests collective
    gpus: int
    nodes: int
    size: int  # nccl-tests' size column, bytes
    busbw: float  # GB/s
    source: str
    ring: bool = False  # measured with NVLink SHARP off
    guidance: bool = False  # NVIDIA's expected figure, not a run

    @property
    def name(self) -> str:
        algo = "-ring" if self.ring else ""
        where = self.source.split()[0].rstrip("/").rsplit("/", 1)[-1].split("_results")[0]
        return f"{self.gpu}-{self.kind}{algo}-{self.nodes}x{self.gpus // self.nodes}-{self.size // MiB}MiB-{where}"


ROWS = (
    # H100 SXM, one node: NVLS all-reduce (NCCL's default there), a curve with its sizes (NCCL 2.18.5).
    Published("h100", "all_reduce", 8, 1, 256 * MiB, 423.38, AZURE_H100),
    Published("h100", "all_reduce", 8, 1, 512 * MiB, 438.46, AZURE_H100),
    Published("h100", "all_reduce", 8, 1, GiB, 466.35, AZURE_H100),
    Published("h100", "all_reduce", 8, 1, 8 * GiB, 478.87, AZURE_H100),
    # NVIDIA: "a peak busBw of ~480GB/s (algbw ~275GB/s)" on 8 GPUs with NVLS; 370 GB/s effective
    # NVLink for NCCL_ALGO=RING and for every collective but all-reduce.
    Published("h100", "all_reduce", 8, 1, 8 * GiB, 480.0, TESTS_212, guidance=True),
    Published("h100", "all_reduce", 8, 1, 8 * GiB, 370.0, TESTS_212, ring=True, guidance=True),
    Published("h100", "reduce_scatter", 8, 1, 8 * GiB, 370.0, TESTS_212, guidance=True),
    Published("h100", "all_to_all", 8, 1, 8 * GiB, 370.0, TESTS_212, guidance=True),
    # all_reduce_perf -b 2G -e 4G on 2..8 GPUs of one node, NCCL_ALGO=RING: "about 365-370" for
    # every count; NCCL_ALGO=NVLS: 365-370 up to 4 GPUs, then 420, 440, 460, 480 on 5..8.
    Published("h100", "all_reduce", 2, 1, 4 * GiB, 367.5, NCCL_1455, ring=True),
    Published("h100", "all_reduce", 8, 1, 4 * GiB, 367.5, NCCL_1455, ring=True),
    Published("h100", "all_reduce", 4, 1, 4 * GiB, 367.5, NCCL_1455),
    Published("h100", "all_reduce", 5, 1, 4 * GiB, 420.0, NCCL_1455),
    Published("h100", "all_reduce", 6, 1, 4 * GiB, 440.0, NCCL_1455),
    Published("h100", "all_reduce", 7, 1, 4 * GiB, 460.0, NCCL_1455),
    Published("h100", "all_reduce", 8, 1, 4 * GiB, 480.0, NCCL_1455),
    # NCCL 2.30.4, 8 GPUs, NVLS off -> on: busbw 370 -> 480.
    Published("h100", "all_reduce", 8, 1, 8 * GiB, 370.0, NCCL_2140, ring=True),
    Published("h100", "all_reduce", 8, 1, 8 * GiB, 480.0, NCCL_2140),
    # all_gather_perf -b 128M -e 16384M -g 8: "saturated at ~360"; NVIDIA: "exactly what we'd expect".
    Published("h100", "all_gather", 8, 1, 16 * GiB, 360.0, "https://github.com/NVIDIA/nccl-tests/issues/326"),
    # Across nodes, eight 400 Gb/s InfiniBand NICs a node. 4 nodes, -e 16g: max busbw 365.84
    # (NVIDIA: "a good number", peak 400 with 8 NICs).
    Published("h100", "all_reduce", 32, 4, 16 * GiB, 365.84, "https://github.com/NVIDIA/nccl-tests/issues/309"),
    # NVIDIA: ~48 GB/s per CX7 NIC, "aggregated to achieve up to ~396GB/s with the RING protocol"
    # (2 nodes, NCCL_ALGO=RING as NVIDIA advises for 2 nodes).
    Published("h100", "all_reduce", 16, 2, 8 * GiB, 396.0, "https://github.com/NVIDIA/nccl-tests/issues/319",
              ring=True, guidance=True),
    Published("h100", "all_to_all", 16, 2, 8 * GiB, 2 / 1 * NDR_NIC, TESTS_130_267, guidance=True),
    Published("h100", "all_to_all", 32, 4, 8 * GiB, 4 / 3 * NDR_NIC, TESTS_130_267, guidance=True),
    Published("h100", "all_to_all", 1024, 128, 8 * GiB, 128 / 127 * NDR_NIC, TESTS_130_267, guidance=True),
    # H200 SXM, one node, NVLS all-reduce (NCCL 2.20.5; and a user's "peak bandwidth of 475 GB/s",
    # -b 64k -e 4G, NCCL 2.20.3).
    Published("h200", "all_reduce", 8, 1, 256 * MiB, 432.24, AZURE_H200),
    Published("h200", "all_reduce", 8, 1, 512 * MiB, 442.72, AZURE_H200),
    Published("h200", "all_reduce", 8, 1, GiB, 467.58, AZURE_H200),
    Published("h200", "all_reduce", 8, 1, 8 * GiB, 479.98, AZURE_H200),
    Published("h200", "all_reduce", 8, 1, 4 * GiB, 475.0, "https://github.com/NVIDIA/nccl-tests/issues/272"),
    # H800, one node of 8 ("H800 * 8"; the user sets it against 200 x 2 x 7/8): all-reduce busbw 215.
    Published("h800", "all_reduce", 8, 1, 8 * GiB, 215.0, "https://github.com/NVIDIA/nccl/issues/1374"),
)

# Published figures left out of the test, and why (docs/benchmarks.md shows the model beside each).
EXCLUDED = (
    ("h100 all_reduce 2x8 470 GB/s, default NCCL (nccl-tests #309)",
     "NCCL's NVLS tree on 2 nodes, not modelled; NVIDIA says 2-node default figures mislead and to "
     "measure the network with NCCL_ALGO=RING (nccl #1031, nccl-tests #196, #290), the 396 row above"),
    ("h100 all_reduce 4x8 320 GB/s (nccl #1221)", "RoCE, not the InfiniBand fabric the preset describes"),
    ("4x8 all_reduce 385-391 GB/s at 1-16 GiB, NCCL 2.19.3 (nccl #1222)",
     "neither the GPU nor the NICs are stated in what was read"),
    ("h100 all_reduce 4x8 330.93, all_gather 4x8 323.53 GB/s at 8 GiB (ZiyanIshani/vpbenchmarking)",
     "the run's summary gives 3 active 400 Gb/s ports a node, which cannot carry 330 GB/s, and its "
     "single-node all_gather peaks at 183 GB/s, half NVIDIA's expected 360: its setup is not the preset's"),
    ("h100 all_gather 32x8 ~200 GB/s at 2 GiB (nccl #1218)",
     "RoCE, one timed iteration (-n 1), and the maintainers' answer was not read"),
    ("h100 reduce_scatter 4..128 nodes 360..260 GB/s (nccl #1229)", "neither the size nor the NICs are stated"),
    ("h100 2x8 all_reduce 216-231, all_gather ~101, alltoall ~25 GB/s (nccl #2409)",
     "reported as an under-performing system, not a reference"),
    ("h100 2x8 all_reduce 353.85 / alltoall 36.83 GB/s (test_gpu_scripts report, PDF targets 491.84 / 76.54)",
     "4 HCAs in use, targets second-hand"),
    ("h800 2x8 all_reduce 161 (nccl-tests #153)", "100 Gb/s NICs (not the preset's), units unclear"),
    ("h800 DeepEP dispatch/combine 153-158 GB/s NVLink, 43-58 GB/s RDMA (DeepEP docs/legacy.md)",
     "DeepEP kernels' bottleneck bandwidth, not nccl-tests busbw"),
    ("h800 NVLink 160 GB/s one way (DeepSeek-V3 #28)", "a link measurement, not a busbw; the model's ring "
     "busbw on 8 H800s is 164 GB/s"),
)


def preset(name: str) -> ClusterConfig:
    return ClusterConfig(**yaml.safe_load((REPO / "conf" / "cluster" / f"{name}.yaml").read_text()))


def model_busbw(row: Published) -> float:
    """The model's busbw for the row: its preset, NVLS off where the source had it off."""
    cluster = preset(row.gpu)
    if row.ring:
        cluster = dataclasses.replace(cluster, nvls=False)
    group = CommGroup(row.gpus, row.gpus // row.nodes)
    return Machine(cluster).bus_bandwidth(row.kind, row.size, group)


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_model_is_within_15_percent_of_the_published_busbw(row):
    model = model_busbw(row)
    assert abs(model - row.busbw) <= TOLERANCE * row.busbw, (
        f"model {model:.1f} GB/s vs published {row.busbw:.1f} GB/s ({row.source})")


def test_rows_cover_every_collective_gpu_and_scale():
    """The table spans the four collectives, the three GPUs, one node and many, 8 to 1024 GPUs."""
    assert {r.kind for r in ROWS} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert {r.gpu for r in ROWS} == {"h100", "h200", "h800"}
    assert min(r.gpus for r in ROWS) <= 8 and max(r.gpus for r in ROWS) >= 1024
    assert any(r.nodes > 1 and not r.guidance for r in ROWS)
    assert all(r.source.startswith("https://") and r.gpus % r.nodes == 0 for r in ROWS)
