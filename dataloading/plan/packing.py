"""How a step's samples become rows: the packing rules the planner arranges a step under.

One option object instead of five keyword arguments restated by every caller: the run's
``DataConfig`` says four of them (``micro_batch_tokens``, ``balance``, ``balance_group``,
``over_budget``), the pipeline the fifth (its micro-batch multiple).
"""
from __future__ import annotations

from dataclasses import dataclass

from dataloading.errors import DataError
from dataloading.plan.mixture import OVER_BUDGET_POLICIES


@dataclass(frozen=True)
class Packing:
    #: Tokens a micro-batch holds at most (``data.micro_batch_tokens``); None: one row per rank.
    budget: int | None = None
    #: The balancing method (``dataloading.plan.balance.METHODS``).
    balance: str = "balanced"
    #: Ranks balanced together (0: all of them).
    balance_group: int = 0
    #: What a sample longer than ``budget`` becomes, where its source does not say.
    over_budget: str = "error"
    #: Micro-batches per rank come in multiples of this (the pipeline's stages; 1 without PP).
    micro_batch_multiple: int = 1

    def __post_init__(self) -> None:
        if self.over_budget not in OVER_BUDGET_POLICIES:
            raise DataError(f"data.over_budget={self.over_budget!r} is not a policy; use one of "
                            f"{list(OVER_BUDGET_POLICIES)}", kind="config")

    @classmethod
    def of(cls, data, micro_batch_multiple: int = 1) -> "Packing":
        """The rules a run's data config (``dataloading.config.DataConfig``) sets."""
        return cls(budget=data.micro_batch_tokens, balance=data.balance, balance_group=data.balance_group,
                   over_budget=data.over_budget, micro_batch_multiple=int(micro_batch_multiple))
