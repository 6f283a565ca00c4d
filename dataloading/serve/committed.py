"""What both loaders (the inline ``StepLoader``, the Ray ``RayStepLoader``) keep of a run between
steps, in one home: the planner holding the *committed* state (the state after the last step
handed out, never a built-ahead one) and the totals of the data problems met. So their
checkpoint (``state_dict``) has one format, whichever backend saved it, and a run resumes on
either (Megatron-Energon's rule: save keys and cursors, never buffered tensors)."""
from __future__ import annotations

from collections.abc import Mapping

from dataloading.construct.batch import StepBatch


class CommittedSteps:
    """Base of the loaders; each says how to forget the steps built ahead (``_drop_ahead``) and
    how to ``close``."""

    def __init__(self, planner, constructor, dp_rank: int, prefetch: int):
        if not 0 <= dp_rank < planner.dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside dp_size={planner.dp_size}")
        self.planner = planner  # holds the committed state
        self.constructor = constructor
        self.dp_rank = dp_rank
        self.prefetch = prefetch  # steps in flight ahead of the trainer
        self.problems: dict[str, int] = {}  # totals over the steps handed out

    def _drop_ahead(self) -> None:
        """Forget the steps built ahead (the committed state does not include them)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _hand_out(self, item: tuple, wait: float) -> StepBatch:
        """A built step (batch, planner state after it) is handed out: that state becomes the
        committed one and the step's problems count."""
        batch, state = item
        batch.data_wait_s = wait
        self.planner.load_state_dict(state)
        for k, v in batch.problems.items():
            self.problems[k] = self.problems.get(k, 0) + v
        return batch

    def set_weights(self, weights) -> None:
        """Change the mixture from the next step on (curriculum); built-ahead steps are rebuilt."""
        self._drop_ahead()
        self.planner.set_weights(weights)

    # ---- checkpointing --------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"planner": self.planner.state_dict(), "problems": dict(self.problems)}

    def load_state_dict(self, sd: Mapping) -> None:
        self._drop_ahead()
        self.planner.load_state_dict(sd["planner"])
        self.problems = dict(sd.get("problems", {}))

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
