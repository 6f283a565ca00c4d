"""`omni` with one injected fault, for tests/runtime/test_faults.py. Not a test itself.

    torchrun ... tests/runtime/fault_launch.py train OVERRIDES...

$OMNI_STOP_GRACE_S, when set, replaces the trainer's STOP_GRACE_MIN_S (10 s). $OMNI_FAULT is
``KIND:RANK:STEP``; the fault fires on that rank, in the launcher's first attempt
only (TORCHELASTIC_RESTART_COUNT 0), so a restarted job runs clean. Kinds:

- ``kill_mid_step``: SIGKILL once the step's forward and backward are done, before the gradient sync;
- ``kill_mid_save``: SIGKILL right after this rank's DCP shards of step STEP are written (before
  the manifest and the rename);
- ``hang``: the step's forward never returns (sleeps for an hour);
- ``worker_hang``: every media item this rank's data workers decode hangs (STEP unused).

The patches wrap Omni's own functions from outside; the code under test is unchanged.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _kill_self() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _on_phase(step: int, phase: str, action) -> None:
    from omni.runtime.trainer import Trainer

    original = Trainer._phase

    def patched(self, name):
        original(self, name)
        if name == phase and self._step == step:
            action()

    Trainer._phase = patched


def _kill_after_shards(step: int) -> None:
    import torch.distributed.checkpoint as dcp

    original = dcp.save

    def patched(state, *args, checkpoint_id=None, **kwargs):
        out = original(state, *args, checkpoint_id=checkpoint_id, **kwargs)
        if str(checkpoint_id).endswith(f"step_{step:08d}"):
            _kill_self()
        return out

    dcp.save = patched


class _Stuck:
    """A media processor whose every call hangs (the data worker holding it never returns)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *args, **kwargs):
        time.sleep(3600)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _stuck_workers() -> None:
    import omni.models.build as build

    original = build.media_processors
    build.media_processors = lambda model: {m: _Stuck(p) for m, p in original(model).items()}


def install(kind: str, step: int) -> None:
    if kind == "kill_mid_step":
        _on_phase(step, "gradient sync", _kill_self)
    elif kind == "kill_mid_save":
        _kill_after_shards(step)
    elif kind == "hang":
        _on_phase(step, "forward and backward", lambda: time.sleep(3600))
    elif kind == "worker_hang":
        _stuck_workers()
    else:
        raise SystemExit(f"fault_launch: unknown fault kind {kind!r}")


def main() -> None:
    grace = os.environ.get("OMNI_STOP_GRACE_S")
    if grace:  # how long a rank stuck after a stop signal holds on (fault_helpers.command's stop_grace_s)
        import omni.runtime.trainer as trainer

        trainer.STOP_GRACE_MIN_S = float(grace)
    spec = os.environ.get("OMNI_FAULT")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        kind, rank, step = spec.split(":")
        if int(rank) == int(os.environ.get("RANK", "0")):
            install(kind, int(step))
    from recipes.cli import entry

    entry(sys.argv[1:])


if __name__ == "__main__":
    main()
