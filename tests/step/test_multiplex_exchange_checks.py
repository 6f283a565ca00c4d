"""``multiplex.exchange``, ``multiplex.lookahead`` and ``multiplex.fill_bubbles`` mistakes end in one line naming the key and
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


def test_fill_bubbles_mistakes_end_in_one_line_before_start():
    from recipes.checks import check_config

    with pytest.raises(ConfigError) as e:
        check_multiplex(_with(fill_bubbles="yes"))
    assert "multiplex.fill_bubbles='yes'" in str(e.value) and "auto, true, false" in str(e.value)
    # true where it cannot apply (the demo without PP): named with the reason, once the launch is known
    from omegaconf import OmegaConf

    from recipes.compose import compose_config

    cfg = OmegaConf.to_object(compose_config(["multiplex.fill_bubbles=true"]))
    with pytest.raises(ConfigError) as e:
        check_config(cfg, world_size=1)
    line = str(e.value)
    assert "\n" not in line and "multiplex.fill_bubbles=true cannot apply here" in line and "parallel.pp=1" in line
