"""Training one's own model after the demo in the same run dir: the demo's checkpoint is refused
in one line naming both models and the fix (it used to be resumed and end in a 50-line DCP
"Size mismatch" traceback), and the fix it names works."""
from __future__ import annotations

import json

from omni.runtime.checkpoint_manifest import MANIFEST
from recipe_helpers import tiny_overrides
from recipes.cli import main


def test_another_model_in_the_demos_run_dir_is_refused_in_one_line(capsys, demo_root, tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", *tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": 2})]) == 0
    demo_ckpt = run_dir / "checkpoints" / "step_00000002"
    assert json.loads((demo_ckpt / MANIFEST).read_text())["model"]["summary"]["hidden"] == 128
    capsys.readouterr()

    mine = tiny_overrides(demo_root, run_dir, **{"trainer.max_steps": 2, "model.hidden_size": 64})
    rc = main(["train", *mine])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and "Size mismatch" not in err
    errors = [line for line in err.splitlines() if line.startswith("omni: error: ")]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
    line = errors[0]
    assert f"checkpoint {demo_ckpt} holds another model" in line
    assert "vocab 272, hidden 128, 4 layers, encoders audio+image" in line  # the demo's
    assert "vocab 272, hidden 64, 4 layers" in line  # the config's
    assert "checkpoint.resume=never" in line and "trainer.run_dir" in line

    # The fix the line names: start fresh.
    assert main(["train", *mine, "checkpoint.resume=never"]) == 0
    assert json.loads((demo_ckpt / MANIFEST).read_text())["model"]["summary"]["hidden"] == 64
