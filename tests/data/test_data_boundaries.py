"""The data plane must run in plain worker processes: no omni, parallel or torch.distributed."""
import ast
import subprocess
import sys
from pathlib import Path

import dataloading

FORBIDDEN = ("omni", "parallel", "torch.distributed")


def test_dataloading_imports_stay_inside_the_data_plane():
    root = Path(dataloading.__file__).parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN[:2] or n.startswith(FORBIDDEN[2])]
    assert not bad, bad


def test_import_dataloading_is_light():
    code = ("import sys, dataloading; mods = set(sys.modules); "
            "print(sorted(m for m in ('PIL', 'soundfile', 'webdataset', 'wids', 'transformers', 'omni') if m in mods))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(dataloading.__file__).parent.parent)
    assert out.stdout.strip() == "[]"
    assert dataloading.Planner.__name__ == "Planner"  # lazy re-export resolves
