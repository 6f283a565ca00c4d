import textwrap

import pytest

from dataloading.errors import DataError
from dataloading.plan.mixture import load_mixture


@pytest.fixture
def mixdir(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    return tmp_path


def write(folder, text):
    path = folder / "mix.yaml"
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_valid_mixture_resolves_paths(mixdir):
    path = write(mixdir, """
        sources:
          - {name: a, path: a, weight: 0.25}
          - name: b
            path: b
            weight: 3
        """)
    mix = load_mixture(path)
    assert [s.name for s in mix.sources] == ["a", "b"]
    assert mix.sources[0].path == (mixdir / "a").resolve()
    assert mix.weights == {"a": 0.25, "b": 3.0} and mix.eval is None


@pytest.mark.parametrize("body, line, needle", [
    # line numbers are 1-based lines of the file as written
    ("sources:\n  - name: a\n    path: a\n", 2, "sources[0]: missing key 'weight'"),
    ("sources:\n  - name: a\n    path: a\n    weight: -1\n", 4, "sources[0].weight must be a number >= 0"),
    ("sources:\n  - name: a\n    path: a\n    weight: lots\n", 4, "sources[0].weight must be a number"),
    ("sources:\n  - {name: a, path: a, weight: 1}\n  - {name: a, path: b, weight: 1}\n", 3,
     "sources[1].name 'a' repeats sources[0].name"),
    ("sources:\n  - name: a\n    path: nowhere\n    weight: 1\n", 3, "sources[0].path: folder"),
    ("sources:\n  - name: a\n    path: a\n    wieght: 1\n    weight: 1\n", 4, "unknown key 'wieght'"),
    ("source:\n  - {name: a, path: a, weight: 1}\n", 1, "unknown key 'source'"),
    ("sources: {name: a}\n", 1, "'sources' must be a non-empty list"),
    ("sources:\n  - {name: a, path: a, weight: 0}\n", 2, "all source weights are 0"),
    # a source's weight schedule and options
    *[(f"sources:\n  - name: a\n    path: a\n    {body}\n", line, needle) for body, line, needle in [
        ("weight: {0: 1, 0: 2}", 4, "schedule steps must be increasing"),
        ("weight: {-1: 1}", 4, "schedule steps must be integers >= 0"),
        ("weight: 1\n    over_budget: chop", 5, "over_budget must be one of"),
        ("weight: 1\n    image: {resize: stretch}", 5, "image.resize must be one of"),
        ("weight: 1\n    audio: {chunk_seconds: -3}", 5, "audio.chunk_seconds must be a positive float"),
        ("weight: 1\n    chat_template: no prompt here", 5, "chat_template must be a string with exactly one"),
        ("weight: 1\n    max_media: many", 5, "max_media must be an integer"),
    ]],
])
def test_mixture_errors_name_line_and_key(mixdir, body, line, needle):
    path = write(mixdir, body)
    with pytest.raises(DataError) as info:
        load_mixture(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:{line}: "), msg
    assert needle in msg
    assert "\n" not in msg


def test_missing_mixture_file(tmp_path):
    with pytest.raises(DataError, match="mixture file .*not found"):
        load_mixture(tmp_path / "absent.yaml")


def test_yaml_syntax_error_has_line(mixdir):
    path = write(mixdir, "sources:\n  - name: a\n   bad: [\n")
    with pytest.raises(DataError, match=rf"{path}:\d+: not valid YAML"):
        load_mixture(path)
