"""Whose rules a run follows: the device's own, or CUDA's on any device (``trainer.device_rules``).

Every decision that depends on the accelerator is taken here, once, from one object that the
layout carries: the bf16 autocast and FSDP parameter dtype that ``auto`` stands for, whether
media features travel to the device before the step, which attention kernels ``auto`` picks,
the memory a rank may plan with, and whether the host group is a gloo group of its own. With ``device_rules=cuda`` a CPU run takes each of them as a CUDA run would
(the Triton kernels run interpreted where the GPU would compile them, the device memory is the
stated ``trainer.device_memory_gib``), and ``parallel.strict_device`` checks that no tensor the
GPU would hold is read by the host on the hot path. That is how the CPU tests exercise the GPU's
paths: on the CPU every ``auto`` would otherwise take its CPU value and hide them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from parallel.sizing import PRECISIONS, LayoutError  # trainer.precision takes parallel.mixed_precision's values

DEVICE_RULES = ("auto", "cuda")
# A stated device size for CUDA's rules on a host without one: an 80 GB H100, the smallest
# device Omni's presets are sized for.
EMULATED_MEMORY_GIB = 80.0


class DeviceRulesError(LayoutError):
    """A device-rules setting that cannot be taken (a user mistake, one line)."""


@dataclass(frozen=True)
class DeviceRules:
    """The device-dependent decisions of one run (see the module docstring)."""

    device: torch.device  # where this rank's tensors really live
    cuda: bool = False  # take CUDA's decisions (on a GPU: always)
    precision: str = "auto"  # trainer.precision: what the run computes in
    memory_gib: float | None = None  # the stated device size under emulation (None: measure it)

    @property
    def emulated(self) -> bool:
        """CUDA's rules on a device that is not one: the strict device check applies."""
        return self.cuda and self.device.type != "cuda"

    @property
    def bf16(self) -> bool:
        """bf16 autocast: ``trainer.precision=auto`` is bf16 under CUDA's rules, fp32 else."""
        return self.precision == "bf16" or (self.precision == "auto" and self.cuda)

    def fsdp_bf16(self, mode: str) -> bool:
        """FSDP's parameter dtype (``parallel.mixed_precision``): ``auto`` follows what the run
        computes in. Not the device alone: an fp32 run (``trainer.precision=fp32``) under FSDP
        would otherwise feed bf16 activations to the modules FSDP does not own (MoE routers and
        experts, still fp32), and with no autocast to reconcile them a matmul of the two fails."""
        return mode == "bf16" or (mode == "auto" and self.bf16)

    @property
    def features_on_device(self) -> bool:
        """Media features travel to the device with the step (over the peers' device group),
        as on NCCL, instead of riding in the pickled host objects."""
        return self.cuda

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element the memory plans count (bf16 on the GPU)."""
        return 2 if self.bf16 else 4

    def attention_backend(self, setting: str) -> str:
        """What ``model.attn_backend=auto`` stands for: the varlen kernels on CUDA (flash-attn if
        installed, else Triton: run interpreted under emulation, which needs
        ``TRITON_INTERPRET=1`` before Triton is imported), PyTorch's SDPA on the CPU."""
        if setting != "auto" or not self.cuda:
            return setting
        if self.device.type == "cuda":
            return "auto"  # decided per call from the tensors (dtype, head size)
        if not _has("triton"):
            return "sdpa"
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise DeviceRulesError("trainer.device_rules=cuda on a CPU runs the Triton kernels interpreted, as the "
                                   "GPU would run them compiled: set TRITON_INTERPRET=1 in the environment (before "
                                   "Triton is imported), or model.attn_backend=sdpa")
        return "triton"

    @property
    def fused_loss(self) -> bool:
        """The LM head and its cross-entropy through liger-kernel's fused Triton kernel: on a GPU
        where liger-kernel is installed. Elsewhere, and under emulation (the Triton interpreter
        computes bf16 wrongly, and liger's kernels cannot be given fp32 copies as ours are), the
        chunked PyTorch path (``parallel/linear_cross_entropy.py``) runs."""
        return self.device.type == "cuda" and _has("liger_kernel")

    def fp8_warning(self) -> str | None:
        """``parallel.fp8`` on this device: a DeviceRulesError where FP8 matmuls cannot run (a GPU
        before compute capability 8.9), a warning line where they run slowly (the CPU: torch's
        reference kernel, two orders of magnitude below bf16 on the demo), None on an FP8 GPU."""
        if self.device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(self.device)
            if (major, minor) < (8, 9):
                raise DeviceRulesError(f"parallel.fp8=true needs FP8 matmuls (compute capability 8.9 or later: Ada, "
                                       f"Hopper); this GPU has {major}.{minor}: use parallel.fp8=false")
            return None
        return ("omni: warning: parallel.fp8=true on the CPU runs torch's reference FP8 matmul, far slower than "
                "bf16; FP8 is for GPUs of compute capability 8.9 or later")

    def device_memory_bytes(self) -> float | None:
        """The device's memory for planning: the GPU's own, the stated size under emulation,
        None (no limit worth planning around) for host memory under the CPU's rules."""
        if self.device.type == "cuda":
            return float(torch.cuda.get_device_properties(self.device).total_memory)
        if self.cuda:
            return float((self.memory_gib or EMULATED_MEMORY_GIB) * 2**30)
        return None

    def free_memory_bytes(self, held: float = 0.0) -> float | None:
        """Free device memory once ``held`` more bytes are allocated (what the model's
        gradients and optimizer state will take; ``free_memory_at_steady_state``). On a GPU
        the driver's reading; under emulation the stated size less what this process holds on
        the "device" (its parameters and buffers are counted by the caller in ``held``)."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return float(free) - held
        total = self.device_memory_bytes()
        return None if total is None else total - held


def resolve_device_rules(setting: str, device: torch.device, precision: str = "auto",
                         memory_gib: float | None = None) -> DeviceRules:
    """``trainer.device_rules`` (auto: the device's own) on ``device``."""
    if setting not in DEVICE_RULES:
        raise DeviceRulesError(f"trainer.device_rules={setting!r} is not one of {', '.join(DEVICE_RULES)}")
    if precision not in PRECISIONS:
        raise DeviceRulesError(f"trainer.precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    if memory_gib is not None and not memory_gib > 0:
        raise DeviceRulesError(f"trainer.device_memory_gib={memory_gib} must be > 0 (or null: the device's own)")
    device = torch.device(device)
    return DeviceRules(device, cuda=setting == "cuda" or device.type == "cuda", precision=precision,
                       memory_gib=memory_gib)


def free_memory_at_steady_state(rules: DeviceRules, modules, optimizer_slots: int = 2) -> float | None:
    """Free device memory once training runs: what is free now, less the gradients and the
    optimizer state (``optimizer_slots`` fp32 tensors per trainable element: AdamW's two
    moments) that the first step will allocate. Read at start-up, before either exists, the
    free memory overstates the steady state by about three times the trainable weights. Under
    emulation the parameters and buffers themselves are counted too (nothing is on a device)."""
    grads = optim = held = 0.0
    seen: set[int] = set()
    for module in modules:
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            local = p.to_local() if hasattr(p, "to_local") else p
            n = local.numel()
            if p.requires_grad:
                grads += n * local.element_size()
                optim += n * 4 * optimizer_slots
            if rules.device.type != "cuda":
                held += n * local.element_size()
        if rules.device.type != "cuda":
            held += sum(b.numel() * b.element_size() for b in module.buffers())
    return rules.free_memory_bytes(held + grads + optim)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
