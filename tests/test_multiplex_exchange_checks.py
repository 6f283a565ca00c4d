"""``multiplex.exchange`` and ``multiplex.lookahead`` mistakes end in one line naming the key and
the fix, before anything starts (``recipes.checks``)."""
from __future__ import annotations

import dataclasses

import pytest

from omni.errors import ConfigError
from recipes.checks import check_multiplex
from recipes.schema import OmniConfig


def _with(**multiplex) -> OmniConfig:
    cfg = OmniConfig()
    return dataclasses.replace(cfg, multiplex=dataclasses.replace(cfg.multiplex, **multiplex))


@pytest.mark.parametrize("value", ["all_to_all", "p2p"])
def test_exchange_modes_pass(value):
    check_multiplex(_with(exchange=value))


@pytest.mark.parametrize("field,value,needles", [
    ("exchange", "p2pp", ("multiplex.exchange='p2pp'", "all_to_all, p2p", "did you mean multiplex.exchange=p2p")),
    ("lookahead", -1, ("multiplex.lookahead=-1", ">= 0")),
    ("lookahead", 1.5, ("multiplex.lookahead=1.5", "whole number")),
])
def test_bad_values_name_the_key(field, value, needles):
    with pytest.raises(ConfigError) as e:
        check_multiplex(_with(**{field: value}))
    line = str(e.value)
    assert "\n" not in line and all(n in line for n in needles), line
