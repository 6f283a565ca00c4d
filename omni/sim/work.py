"""The simulated steps' work as document lengths and media items: every DP group's
micro-batches (``StepWork``), and the shares of their LLM tokens that come from media."""
from __future__ import annotations

from dataclasses import dataclass, field


def media_rows(media) -> list[tuple[str, int]]:
    """(modality, encoder tokens, LLM rows) items as the shared cost model and the planners
    count them: by their LLM placeholders."""
    return [(m, int(rows)) for m, _, rows in media]



@dataclass
class MicroBatchWork:
    docs: list[int] = field(default_factory=list)  # LLM document lengths (text + media tokens)
    media: list[tuple[str, int, int]] = field(default_factory=list)  # (modality, encoder tokens, LLM rows)

    @property
    def tokens(self) -> int:
        return int(sum(self.docs))


@dataclass
class StepWork:
    groups: list[list[MicroBatchWork]]  # [DP group][micro-batch]
    balance: float  # max / mean cost over DP groups, as the balancer left it
    # The media share the step was drawn at (source=lengths: image_ratio or the schedule's value
    # at run_fraction; source=mixture: the realised share of the planner's step).
    image_ratio: float | None = None
    run_fraction: float | None = None  # where in the run the step sits (None: no schedule / run_steps)
    samples: int = 0  # the step's samples, and how many of them carry media (for the report)
    media_samples: int = 0

    def tokens(self) -> int:
        return sum(mb.tokens for g in self.groups for mb in g)

    def media(self) -> list[tuple[str, int, int]]:
        return [it for g in self.groups for mb in g for it in mb.media]

    def docs(self) -> list[int]:
        return [d for g in self.groups for mb in g for d in mb.docs]


def media_llm_tokens(media) -> int:
    """LLM tokens of (modality, encoder tokens, LLM rows) items."""
    return int(sum(rows for _, _, rows in media))


def sample_media_share(work: MicroBatchWork) -> float:
    """The share of a sample's (or micro-batch's) LLM tokens that come from media."""
    return media_llm_tokens(work.media) / work.tokens if work.tokens else 0.0


def step_media_share(step: StepWork) -> float:
    """The share of a step's LLM tokens that come from media (what image_ratio sets in expectation)."""
    total = step.tokens()
    return media_llm_tokens(step.media()) / total if total else 0.0
