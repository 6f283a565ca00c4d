"""Trainer, optimizer and checkpoint knobs (the ``trainer``, ``optim``, ``checkpoint`` groups)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from parallel.device_rules import DEVICE_RULES, PRECISIONS as TRAINER_PRECISIONS  # noqa: F401  (checked in recipes/checks.py)
# checkpoint.resume keywords; any other value is the path of a checkpoint folder.
RESUME_CHOICES = ("auto", "never")


@dataclass
class OptimGroupConfig:
    """The settings one entry of ``optim.groups`` may hold (None: optim's own). The entries
    are plain mappings in the schema (OmegaConf cannot add a key of a dataclass-valued dict
    from the command line: ``+optim.groups.llm.lr=2e-5`` must work) and are read into this
    by ``omni.runtime.optim.group_settings``, which names an unknown setting."""

    lr: Optional[float] = None
    weight_decay: Optional[float] = None


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 20
    # Cosine decay to lr * min_lr_ratio at trainer.max_steps.
    min_lr_ratio: float = 0.1
    # Global-norm gradient clipping; 0 disables.
    clip_grad_norm: float = 1.0
    # Per-module settings, keyed by module name (llm, encoders, projectors, encoder.<slot>,
    # projector.<slot>; omni/models/freeze.py), e.g. {projector: {lr: 1e-3}, llm: {lr: 2e-5}}.
    # The most specific name covering a parameter wins; modules not named use lr and
    # weight_decay above. Each peak lr follows the same warmup + cosine. Norm gains and biases
    # (ndim < 2) are never decayed, whatever a group says.
    # From the command line: +optim.groups.llm.lr=2e-5 (a new key takes the +).
    groups: Dict[str, Any] = field(default_factory=dict)


@dataclass
class WandbConfig:
    """``trainer.wandb``: used when ``trainer.log_to`` lists wandb."""

    project: str = "omni"
    entity: Optional[str] = None
    # offline (nothing leaves the machine; `wandb sync <dir>/wandb/offline-run-*` uploads
    # later), online or disabled. None: the WANDB_MODE environment variable, else offline.
    mode: Optional[str] = None
    # Where wandb writes its files (<dir>/wandb/...). None: the run dir.
    dir: Optional[str] = None


@dataclass
class MlflowConfig:
    """``trainer.mlflow``: used when ``trainer.log_to`` lists mlflow."""

    # None: a file store in the run dir (file:<run_dir>/mlruns; `mlflow ui --backend-store-uri`
    # shows it). Or any MLflow tracking URI (http://..., sqlite:///..., databricks).
    tracking_uri: Optional[str] = None
    experiment: str = "omni"


@dataclass
class StageConfig:
    """One entry of ``trainer.stages``: ``steps`` optimizer steps (None: to the end; the last
    stage only) during which the modules in ``train`` train and the others stay unchanged."""

    steps: Optional[int] = None
    # Module names (omni/models/freeze.py) or "all" (every module model.freeze leaves).
    train: List[str] = field(default_factory=lambda: ["all"])


@dataclass
class TrainerConfig:
    max_steps: int = 100
    # Stop after this step as if preempted (checkpoint saved, no eval); the lr schedule still
    # follows max_steps, so a later run with checkpoint.resume=auto continues seamlessly.
    # Useful for time-limited cluster jobs. None: run to max_steps.
    stop_at: Optional[int] = None
    # A schedule of what trains: e.g. [{steps: 500, train: [projectors]}, {train: [all]}]
    # (omni/runtime/stages.py). Empty: every module model.freeze leaves trains throughout.
    stages: List[StageConfig] = field(default_factory=list)
    run_dir: str = "runs/${name}"
    seed: int = 0
    # "auto": cuda if available, else cpu.
    device: str = "auto"
    # "auto": bf16 autocast on GPU, fp32 on CPU. Or "fp32" / "bf16".
    precision: str = "auto"
    # Whose rules every device-dependent decision follows (parallel/device_rules.py): "auto",
    # the device's own; "cuda", a GPU's on any device: on the CPU bf16 autocast and FSDP
    # parameters, media features sent ahead to the "device", the Triton kernels (interpreted:
    # needs TRITON_INTERPRET=1), batched copies, memory budgets from device_memory_gib, and the
    # strict device check (parallel/strict_device.py): a host read of a tensor the GPU would
    # hold raises with its call site, and metrics.jsonl counts the step's host syncs.
    device_rules: str = "auto"
    # The device memory (GiB) budgets are planned with under device_rules=cuda on a CPU; null:
    # 80 (an H100). On a GPU its own memory is read and this is ignored.
    device_memory_gib: Optional[float] = None
    log_every: int = 1
    progress: bool = True
    # Experiment trackers the metrics also go to, besides <run_dir>/metrics.jsonl (always
    # written: it is the run's record, which resume truncates and tools read): any of jsonl (a
    # no-op, for clarity), tensorboard, wandb, mlflow (omni/runtime/trackers.py).
    log_to: List[str] = field(default_factory=lambda: ["jsonl"])
    # Kept for existing configs: true adds tensorboard to log_to.
    tensorboard: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    # Validation loss on the held-out set (data.eval_dir, else the mixture's eval: folder; at
    # most eval_samples samples) every this many steps, per sub-folder and overall, in
    # metrics.jsonl as event=validation (omni/runtime/validation.py). 0: off.
    eval_every: int = 0
    # Held-out greedy-generation evaluation at the end of training.
    eval_at_end: bool = True
    eval_samples: int = 64
    eval_batch_size: int = 32
    # A split layout's end-of-run evaluation puts a full copy of the model on every rank's device
    # (each rank then generates for its share of the samples): skipped, with a note, for a model
    # above this many GiB (then evaluate with omni export + omni generate).
    eval_max_gib: float = 8.0
    max_new_tokens: int = 100
    # Numeric guards (docs/fault-tolerance.md). A step whose loss or gradient norm is not finite
    # is skipped: no optimizer or lr-schedule update, its gradients dropped, its sample ids in
    # <run_dir>/flagged_steps.jsonl, the running count in metrics.jsonl (skipped_steps). This
    # many in a row stop the run without saving (1: stop at the first).
    max_bad_steps: int = 3
    # Loss spikes: a step whose loss exceeds the median of the previous loss_spike_window steps by
    # more than loss_spike_sigmas robust standard deviations (read off the window's upper tail,
    # omni/runtime/guards.py; calibrated on the default demo) is logged (with its sample ids) to
    # flagged_steps.jsonl; training goes on. 0: off.
    loss_spike_sigmas: float = 10.0
    loss_spike_window: int = 100
    # Write every step's sample ids, per data-parallel rank, to <run_dir>/samples.jsonl.
    log_samples: bool = False
    # Hang watchdog: a rank that makes no progress (no new phase of a step) for this many
    # seconds prints where it is stuck, what the other ranks were doing and its stacks, and
    # exits with code 75, so the job ends or torchrun restarts it. 0: off.
    hang_timeout_s: float = 1800.0


@dataclass
class CheckpointConfig:
    # Save every N steps (0: only at the end).
    every: int = 0
    # "auto": resume from the latest checkpoint in the run dir if any; "never"; or a checkpoint path.
    resume: str = "auto"
    # Folder for checkpoints; None: <trainer.run_dir>/checkpoints.
    dir: Optional[str] = None
    # Keep the last N checkpoints (0: keep all).
    keep_last: int = 2
    save_at_end: bool = True
    # Write in the background: a save holds the step only while the state is copied to host
    # memory (DCP async_save); the folder appears, complete, when the writer is done.
    async_save: bool = False
    # What resume checks against the manifest, each rank its share of the files: "full"
    # re-hashes them (catches any damage, costs one extra read of the checkpoint spread over
    # all ranks), "size" compares sizes (a truncated or missing file), "none" trusts a folder
    # that has its manifest.
    verify: str = "full"  # one of omni.runtime.checkpoint_manifest.VERIFY_MODES (checked in recipes/checks.py)
