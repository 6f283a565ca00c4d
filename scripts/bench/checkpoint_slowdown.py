"""Demo step time before and after the first checkpoint, with DCP's planning collectives (as
single-process saves were) and without them (``no_dist``, what ``Checkpointer`` does now with
one process). docs/benchmarks.md, "Steps after a checkpoint (one process)".

Each variant is one ``omni train`` run of the CPU demo in its own process (default config,
``--steps`` steps, a checkpoint after step ``--save-at``); the mean step time of the steps
after the save over that of the steps before it (step 1, the warm-up, left out) is the
slowdown. Timings move with the machine's load: the two variants run one after the other and
are compared as ratios, each against its own run's first steps.

    python scripts/bench/checkpoint_slowdown.py [--steps 120] [--save-at 40]
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, parser, save, table

# Runs in the child: the demo's training loop, with the single-process saves either as they
# are or forced through DCP's collectives on the one-rank gloo group (as before the fix).
_CHILD = r"""
import sys
from omni.runtime import checkpoint
if sys.argv[1] == "collectives":
    init = checkpoint.Checkpointer.__init__
    def with_collectives(self, *a, **k):
        init(self, *a, **k)
        self._no_dist = False
    checkpoint.Checkpointer.__init__ = with_collectives
from recipes.train import train_main
sys.exit(train_main(sys.argv[2:]))
"""


def run(variant: str, steps: int, save_at: int, work: Path) -> dict:
    run_dir = work / variant
    cmd = [sys.executable, "-c", _CHILD, variant, f"trainer.run_dir={run_dir}", "trainer.progress=false",
           f"trainer.max_steps={steps}", f"checkpoint.every={save_at}", "trainer.eval_at_end=false",
           "checkpoint.save_at_end=false"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    times = {r["step"]: r["step_time_s"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "step_time_s" in r}
    before = [times[s] for s in range(2, save_at + 1)]
    after = [times[s] for s in range(save_at + 2, steps + 1)]  # the step right after the save holds its write
    return {"variant": variant, "before_s": statistics.mean(before), "after_s": statistics.mean(after),
            "slowdown": statistics.mean(after) / statistics.mean(before)}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--save-at", type=int, default=40)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(v, args.steps, args.save_at, Path(tmp)) for v in ("collectives", "no_dist")]
    print(table(["saves", "step before (s)", "step after (s)", "after / before"],
                [[r["variant"], f"{r['before_s']:.3f}", f"{r['after_s']:.3f}", f"{r['slowdown']:.2f}x"] for r in rows]))
    save(args.out, "checkpoint_slowdown", {"steps": args.steps, "save_at": args.save_at, "rows": rows})


if __name__ == "__main__":
    main()
