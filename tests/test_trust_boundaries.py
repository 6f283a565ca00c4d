"""Trust boundaries: what omni opens to the network, unpickles, imports and runs from config.

- a Ray the data plane starts itself listens on loopback unless data.ray_bind opens it;
- `omni data plan --load-state x.pt` never unpickles objects (torch weights_only);
- encoder class paths name importable classes only: no file paths, nothing called that is not a class;
- a tokenizer directory's custom code is never run.

Each "refused" test also checks that the payload's side effect (a marker file) did not happen.
"""
from __future__ import annotations

import json
import sys
import socket
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dataloading.errors import DataError


# ---- Ray: loopback unless told otherwise ---------------------------------------------------------
def _routable_ipv4() -> str | None:
    """This host's non-loopback IPv4 address (where a default Ray would listen), if it has one."""
    for target in ("10.254.254.254", "8.8.8.8"):  # UDP connect sends nothing; it only picks the route
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((target, 80))
            except OSError:
                continue
            ip = s.getsockname()[0]
            if not ip.startswith("127."):
                return ip
    return None


def test_local_ray_listens_on_loopback_only():
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants

    from dataloading.serve.ray_backend import RayStepLoader

    assert not ray.is_initialized(), "another test left a Ray running in this process"
    switch = ray_constants.ENABLE_RAY_CLUSTER
    loader = RayStepLoader(SimpleNamespace(dp_size=1), None, 0)  # default bind; actors are not started
    try:
        assert loader._connect() is ray and ray.is_initialized()
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
        host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
        assert host == "127.0.0.1"

        @ray.remote(num_cpus=0)
        def where():
            return ray.util.get_node_ip_address()

        assert ray.get(where.remote(), timeout=120) == "127.0.0.1"  # workers start and agree
        other = _routable_ipv4()
        if other is not None:  # the GCS port is not reachable through the host's routable address
            with pytest.raises(OSError):
                socket.create_connection((other, int(port)), timeout=5).close()
        assert ray_constants.ENABLE_RAY_CLUSTER == switch  # Ray's switch is put back after init
    finally:
        ray.shutdown()


def test_ray_bind_is_checked_and_threaded_to_the_loader(monkeypatch):
    pytest.importorskip("ray")
    import dataloading.serve.loader as loader_mod
    import dataloading.serve.ray_backend as ray_backend
    import recipes.data_plane as data_plane
    from dataloading.config import DataConfig
    from dataloading.formats.tokenizer import ByteTokenizer
    from dataloading.serve.ray_local import check_bind
    from recipes.schema import OmniConfig

    assert DataConfig().ray_bind == "127.0.0.1"
    assert check_bind("localhost") == "127.0.0.1" and check_bind("0.0.0.0") == "0.0.0.0"
    with pytest.raises(DataError, match=r"data.ray_bind='my-laptop' is not an IP address") as err:
        ray_backend.RayStepLoader(SimpleNamespace(dp_size=1), None, 0, bind="my-laptop")
    assert "\n" not in str(err.value)
    # build_loader checks it before reading any index (the mixture does not even exist here)
    with pytest.raises(DataError, match="data.ray_bind"):
        data = DataConfig(mixture="/nonexistent/mixture.yaml", global_batch_size=1, micro_batch_tokens=64,
                          backend="ray", ray_bind="0.0.0.0.0")
        loader_mod.build_loader(data, None, {}, seed=0, dp_size=1, dp_rank=0)

    # data.ray_bind -> build_training_loader -> build_loader -> RayStepLoader(bind=...)
    seen = {}

    class FakeRayLoader:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)
            self.problems = {}

    monkeypatch.setattr(ray_backend, "RayStepLoader", FakeRayLoader)
    monkeypatch.setattr(loader_mod, "build_planner", lambda *a, **k: (SimpleNamespace(tables={}), {}))
    monkeypatch.setattr(data_plane, "planner_kwargs",
                        lambda cfg, model: dict(seed=0))
    cfg = OmniConfig()
    cfg.data.backend, cfg.data.ray_bind, cfg.data.ray_address = "ray", "10.1.2.3", None
    out = data_plane.build_training_loader(cfg, "mixture.yaml", ByteTokenizer(), None, {}, dp_size=1, dp_rank=0,
                                           progress=False)
    assert isinstance(out, FakeRayLoader)
    assert seen["bind"] == "10.1.2.3" and seen["address"] is None


# ---- omni data plan --load-state: no unpickling of objects ---------------------------------------
class _RunsCode:
    """Unpickling this creates ``self.marker`` (what a hostile .pt could do instead)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_load_state_refuses_a_pickle_that_runs_code(tmp_path):
    from recipes.plan_cmd import _state_from_file

    live, marker = tmp_path / "control-ran", tmp_path / "ran"
    torch.save({"step": 1, "loader": _RunsCode(live)}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)  # the payload is live: unpickled, it runs
    assert live.exists()

    hostile = tmp_path / "trainer_state.pt"
    torch.save({"step": 1, "loader": {"planner": {"step": 1}, "x": _RunsCode(marker)}}, hostile)
    with pytest.raises(DataError) as err:
        _state_from_file(str(hostile))
    msg = str(err.value)
    assert not marker.exists()
    assert err.value.kind == "config" and "\n" not in msg
    assert str(hostile) in msg and "not a trainer_state.pt that omni wrote" in msg and "refuses" in msg


def test_load_state_reads_a_real_trainer_state(tmp_path):
    from recipes.plan_cmd import _state_from_file

    # What CheckpointManager.save writes: step, the LambdaLR state, the loader state.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    opt.step()
    sched.step()
    planner = {"version": 1, "seed": 7, "step": 3, "global_batch_size": 8,
               "sources": {"shapes": {"epoch": 0, "cursor": 5, "perm_seed": 11}, "text": {"epoch": 1, "cursor": 0}},
               "weights": {"shapes": 0.25, "text": 0.75}, "ema": [0.5, 1.5], "done": False, "note": None}
    path = tmp_path / "trainer_state.pt"
    torch.save({"step": 3, "scheduler": sched.state_dict(),
                "loader": {"planner": planner, "problems": {"decode": 2}}}, path)
    assert _state_from_file(str(path)) == planner
    saved = tmp_path / "state.json"  # a --save-state file still loads too
    saved.write_text(json.dumps(planner))
    assert _state_from_file(str(saved)) == planner
    bad = tmp_path / "empty.pt"
    bad.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.pt: cannot be read as a torch file"):
        _state_from_file(str(bad))


# ---- encoder class paths -------------------------------------------------------------------------
PROBE = '''
from pathlib import Path
Path({marker!r}).write_text("imported")


def make_encoder(*args, **kwargs):
    Path({called!r}).write_text("called")


# a function dressed up with every attribute the plugin check looks for
for _name in ("modality", "Config", "build_config", "processor", "forward", "cost_coefficients",
              "from_pretrained"):
    setattr(make_encoder, _name, lambda *a, **k: None)
'''


@pytest.fixture
def probe_module(tmp_path, monkeypatch):
    """An importable module `omni_trust_probe` that leaves marker files when imported / called."""
    markers = SimpleNamespace(imported=tmp_path / "imported", called=tmp_path / "called")
    (tmp_path / "omni_trust_probe.py").write_text(
        textwrap.dedent(PROBE.format(marker=str(markers.imported), called=str(markers.called))))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "omni_trust_probe", raising=False)
    markers.file = tmp_path / "omni_trust_probe.py"
    return markers


def test_class_path_refuses_file_paths_without_importing(probe_module):
    from omni.models.encoders.registry import build_encoder, get_encoder_class

    for value in (f"{probe_module.file}:make_encoder", "omni_trust_probe.py:make_encoder", "../omni_trust_probe",
                  "..\\omni_trust_probe.make_encoder"):
        with pytest.raises(ValueError) as err:
            get_encoder_class(value)
        msg = str(err.value)
        assert repr(value) in msg and "file path" in msg and "'pkg.mod:Class'" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="file path"):
        build_encoder(f"{probe_module.file}:make_encoder")
    assert not probe_module.imported.exists()  # refused before any import


@pytest.mark.parametrize("value", ["..omni_trust_probe", ".omni_trust_probe:make_encoder", "omni-trust.probe:X",
                                   "omni_trust_probe:make encoder", "1pkg.mod:Cls", "omni_trust_probe:a:b",
                                   "omni.models.encoders.siglip:SiglipEncoder.__class__", "import.mod:Cls",
                                   "omni_trust_probe:", ":make_encoder"])
def test_class_path_refuses_non_identifier_paths(probe_module, value):
    from omni.models.encoders.registry import get_encoder_class

    with pytest.raises(ValueError) as err:
        get_encoder_class(value)
    msg = str(err.value)
    assert repr(value) in msg and "expected 'pkg.mod:Class' or 'pkg.mod.Class'" in msg and "\n" not in msg
    assert not probe_module.imported.exists()


def test_class_path_refuses_functions_and_never_calls_them(probe_module):
    from omni.models.encoders.registry import build_encoder, get_encoder_class

    for value in ("omni_trust_probe:make_encoder", "omni_trust_probe.make_encoder"):
        with pytest.raises(ValueError) as err:
            build_encoder(value, {"width": 3})
        msg = str(err.value)
        assert repr(value) in msg and "names a function, not a class" in msg and "\n" not in msg
    assert probe_module.imported.exists() and not probe_module.called.exists()
    for value, kind in (("os.system", "builtin_function_or_method"), ("os:system", "builtin_function_or_method"),
                        ("omni.models.encoders", "module")):
        with pytest.raises(ValueError, match=f"{value!r} names a {kind}, not a class"):
            get_encoder_class(value)


def test_valid_class_paths_still_work():
    from omni.models.encoders.registry import build_encoder, get_encoder_class
    from omni.models.encoders.siglip import SiglipEncoder
    from omni.models.encoders.whisper import WhisperEncoder

    assert get_encoder_class("omni.models.encoders.siglip:SiglipEncoder") is SiglipEncoder
    assert get_encoder_class("omni.models.encoders.whisper.WhisperEncoder") is WhisperEncoder
    enc = build_encoder("omni.models.encoders.siglip:SiglipEncoder",
                        {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                         "num_attention_heads": 2, "image_size": 16, "patch_size": 8})
    assert isinstance(enc, SiglipEncoder) and enc.output_dim == 16
    with pytest.raises(ValueError, match="not an encoder plugin"):  # a class, but not a plugin
        get_encoder_class("collections:OrderedDict")


# ---- tokenizers: no remote code --------------------------------------------------------------------
def test_tokenizer_with_custom_code_is_refused(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import models, pre_tokenizers

    from dataloading.formats.tokenizer import load_tokenizer

    core = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "</s>": 2}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="</s>") \
        .save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path).eos_id == 2  # the plain directory loads
    marker = tmp_path / "ran"
    (tmp_path / "evil_tok.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "evil_tok.EvilTokenizer"]})
    config_file.write_text(json.dumps(config))
    with pytest.raises(DataError) as err:
        load_tokenizer(tmp_path)
    msg = str(err.value)
    assert str(tmp_path) in msg and "custom Python code" in msg and "\n" not in msg
    assert not marker.exists()
