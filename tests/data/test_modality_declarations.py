"""Media kinds are one declaration each (``dataloading.formats.modality``): the maps other modules
read are derived from ``MODALITIES``, a kind declared in a registry of the test's own reaches
field parsing, placeholder matching and mixture validation, and no module outside the
declarations writes a kind's facts out again."""
from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from dataloading.errors import DataError
from dataloading.formats import media
from dataloading.formats.modality import AUDIO, IMAGE, MODALITIES, VIDEO, Modality, Registry
from dataloading.formats.sample import media_fields, parse_fields, placeholder_modalities
from dataloading.formats.tokenizer import ByteTokenizer
from dataloading.plan.mixture import OPTION_KEYS, load_mixture, option_keys

REPO = Path(__file__).resolve().parents[2]
# A kind Omni does not know, declared here only: nothing global learns of it.
DEPTH = Modality("depth", "<depth>", ("npy",), "a depth map (NPY)", read_meta=lambda data: {"bytes": len(data)},
                 decode=bytes, sniff=lambda data: "npy", options={"max_points": int, "layout": ("hw", "wh")},
                 record_keys=("depths",), part_types=("depth",))
WITH_DEPTH = Registry((*MODALITIES, DEPTH))


def test_the_shared_maps_are_the_declarations():
    from dataloading.convert.records import _MEDIA_KEYS, _PART_KINDS
    from omni.sim.sample_model import KINDS

    assert MODALITIES.names == ("image", "audio", "video")
    for m in MODALITIES:
        assert media.MODALITY_EXTENSIONS[m.name] == m.extensions
        assert media.MEDIA_PLACEHOLDERS[m.name] == m.placeholder
        assert media.encoder_modality(m.name) == m.encoder == KINDS[m.name]
        assert (m.name in media.PLACEHOLDERS) == (m.encoder == m.name)
        assert _MEDIA_KEYS[m.name] == m.record_keys
        assert all(_PART_KINDS[p] == m.name for p in m.part_types)
        assert m.name in OPTION_KEYS
    assert media.ENCODED_AS == {"video": "image"} and VIDEO.encoder == "image"
    assert set(_PART_KINDS) == {p for m in MODALITIES for p in m.part_types}
    assert KINDS["multi_image"] == IMAGE.encoder
    assert media.as_encoder_placeholders("a <video> b") == "a <image> b"


def test_the_byte_tokenizer_reserves_the_declared_ids():
    tok = ByteTokenizer()
    assert tok.placeholder_ids == {"image": 259, "audio": 260} == {m.name: m.byte_token_id for m in (IMAGE, AUDIO)}
    for name, token_id in tok.placeholder_ids.items():
        assert tok.SPECIALS[token_id - 256] == MODALITIES[name].placeholder  # save_hf adds them in id order
    assert tok.encode("<image><audio><video>") == [259, 260, *b"<video>"]  # a video is written as an image first


def test_a_declared_kind_is_parsed_from_its_fields_and_placeholders():
    assert WITH_DEPTH.of_extension("npy") == "depth" and MODALITIES.of_extension("npy") is None
    assert WITH_DEPTH.of_placeholder("<depth>") == "depth" and WITH_DEPTH.of_part_type("depth") == "depth"
    assert placeholder_modalities("<image> then <depth>", WITH_DEPTH) == ["image", "depth"]
    assert placeholder_modalities("<image> then <depth>") == ["image"]  # plain text to the default registry
    fields = {"txt": b"<depth> and <image>", "0.NPY": b"\x00\x01", "1.png": b"png bytes"}
    assert media_fields("s/1", fields, WITH_DEPTH) == [("depth", "0.NPY"), ("image", "1.png")]
    raw = parse_fields("s/1", fields, WITH_DEPTH)
    assert [(kind, name) for kind, name, _ in raw.media] == [("depth", "0.NPY"), ("image", "1.png")]
    assert WITH_DEPTH["depth"].read_meta(raw.media[0][2]) == {"bytes": 2}
    with pytest.raises(DataError, match=r"field '0.NPY' has an unsupported media type; use one of \['flac', "):
        parse_fields("s/1", fields)
    with pytest.raises(DataError, match=r"text placeholders \['image'\] do not match"):
        parse_fields("s/1", {"txt": b"<image>", "npy": b"\x00"}, WITH_DEPTH)


def _mixture(tmp_path: Path, options: str) -> Path:
    (tmp_path / "a").mkdir(exist_ok=True)
    path = tmp_path / "mix.yaml"
    path.write_text(f"sources:\n  - name: a\n    path: a\n    weight: 1\n    {options}\n")
    return path


def test_a_declared_kind_has_its_mixture_options(tmp_path):
    assert option_keys(WITH_DEPTH) == (*OPTION_KEYS[:4], "depth", *OPTION_KEYS[4:])
    mix = load_mixture(_mixture(tmp_path, "depth: {max_points: 3, layout: wh}"), WITH_DEPTH)
    assert mix.sources[0].options.media == {"depth": {"max_points": 3, "layout": "wh"}}
    with pytest.raises(DataError, match=r"mix.yaml:5: sources\[0\]: unknown key 'depth'; expected \['name', 'path', 'weight', "
                                        r"'max_media', 'image', 'audio', 'video', 'chat_template'"):
        load_mixture(_mixture(tmp_path, "depth: {max_points: 3}"))
    with pytest.raises(DataError, match=r"sources\[0\]\.depth\.max_points must be a positive int, got 0"):
        load_mixture(_mixture(tmp_path, "depth: {max_points: 0}"), WITH_DEPTH)
    with pytest.raises(DataError, match=r"sources\[0\]\.depth: unknown key 'fps'; expected \['max_points', 'layout'\]"):
        load_mixture(_mixture(tmp_path, "depth: {fps: 2}"), WITH_DEPTH)
    with pytest.raises(DataError, match=r"sources\[0\]\.depth\.layout must be one of \['hw', 'wh'\], got 'xy'"):
        load_mixture(_mixture(tmp_path, "depth: {layout: xy}"), WITH_DEPTH)


def test_a_registry_refuses_what_two_kinds_would_share():
    with pytest.raises(ValueError, match="two modalities declare the extension 'png'"):
        Registry((IMAGE, replace(DEPTH, extensions=("npy", "png"))))
    with pytest.raises(ValueError, match="two modalities declare the placeholder '<image>'"):
        Registry((IMAGE, replace(DEPTH, placeholder="<image>")))
    with pytest.raises(ValueError, match="two modalities declare the name 'image'"):
        Registry((IMAGE, IMAGE))
    with pytest.raises(ValueError, match="'depth' is encoded as 'video', which is not a declared modality with an "
                                         "encoder of its own"):
        Registry((*MODALITIES, replace(DEPTH, encoded_as="video")))
    assert Registry((*MODALITIES, replace(DEPTH, encoded_as="image"))).encoder_of("depth") == "image"


def test_an_item_is_made_by_the_declared_processor_method():
    class Frames:
        def __call__(self, raw):
            return ("called", raw)

        def video(self, raw):
            return ("video", raw)

    assert IMAGE.make_item(Frames(), 1) == ("called", 1) and VIDEO.make_item(Frames(), 2) == ("video", 2)
    assert VIDEO.made_by(Frames()) and not VIDEO.made_by(lambda raw: raw) and IMAGE.made_by(lambda raw: raw)
    with pytest.raises(DataError, match=r"has video media but the image encoder's processor \(function\) cannot "
                                         r"encode video; use a video-capable vision encoder \(qwen_vl"):
        media.processor_for({"image": lambda raw: raw}, "video", "sample s/1")


# Where a media kind's name may still key a literal: the simulator's workload draws per
# ``data.media_mix`` kind (clip frames, audio lengths, the default mix) are its config's, not a modality's.
SIMULATED_WORKLOAD = {"omni/sim/sample_model.py", "omni/sim/config.py"}


def _restatements(path: Path, facts: set[str], names: set[str]) -> list[str]:
    """A declaration's fact written as a literal, a literal collection or map keyed by two or
    more kind names, or a comparison with a kind name: how a closed map or an if-chain looks."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and node.value in facts:
            found.append(f"{node.lineno}: {node.value!r}")
        keys = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(node, (ast.Tuple, ast.List,
                                                                                          ast.Set)) else []
        if sum(isinstance(k, ast.Constant) and k.value in names for k in keys) >= 2:
            found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
        if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in names
                                                 for c in (node.left, *node.comparators)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_restates_a_declaration():
    names = set(MODALITIES.names)
    facts = {f for m in MODALITIES for f in (m.placeholder, m.description, *m.record_keys, *m.part_types)} - names
    files = [p for root in ("dataloading", "recipes", "omni/sim") for p in sorted((REPO / root).rglob("*.py"))]
    wrong = {str(p.relative_to(REPO)): found for p in files
             if p.name != "modality.py" and str(p.relative_to(REPO)) not in SIMULATED_WORKLOAD
             and (found := _restatements(p, facts, names))}
    assert not wrong, f"write these from dataloading.formats.modality.MODALITIES: {wrong}"


def test_the_restatement_check_finds_a_map_written_out(tmp_path):
    restated = tmp_path / "restated.py"
    restated.write_text('EXPECTED = {"image": 1, "audio": 2}\nKEYS = ("max_media", "image", "audio")\n'
                        'def f(kind):\n    return kind == "video"\nP = "<video>"\n')
    found = _restatements(restated, {"<video>"}, {"image", "audio", "video"})
    assert sorted(f.split(":")[0] for f in found) == ["1", "2", "4", "5"], found
