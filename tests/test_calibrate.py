"""`omni data calibrate` times real micro-batches of the configured model and data and writes a
cost file that `data.cost_file` accepts."""
import yaml

from dataloading.plan.cost import CostModel
from recipes.cli import main


def test_calibrate_writes_a_cost_file_training_can_use(demo_root, tmp_path, capsys):
    out = tmp_path / "cost.yaml"
    argv = ["data", "calibrate", f"data.mixture={demo_root / 'mixture.yaml'}", "--micro-batches", "10",
            "--repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "R^2=" in text and f"data.cost_file={out}" in text
    cm = CostModel.load(out)
    assert set(cm.encoders) == {"image", "audio"} and (cm.coefficients() >= 0).all()
    fit = yaml.safe_load(out.read_text())["fit"]
    assert fit["micro_batches"] >= 10 and fit["r2"] <= 1.0
    # the plan accepts it
    assert main(["data", "plan", f"data.mixture={demo_root / 'mixture.yaml'}", f"data.cost_file={out}",
                 "--dp", "2", "--steps", "1", "--json"]) == 0
