"""The shape of a training step as one pure program (issue 39): how many micro-batches every rank
runs, how long each row is, every pipeline rank's actions with the cuts and tail cuts where
encoder work joins in (pp = 1 included), where each chunk's encoder backward can run and the
later ranks' bubble windows. ``plan_step`` decides it once per step from plain numbers; the
trainer pads its rows to it, the pipeline executor runs it, the multiplexer plans its encoder
calls against it and the simulator costs it. The package also holds what decides the step's encoder work, all pure: the ``multiplex`` group
(``config``), its rules (``multiplex_rules``: placements, action lists, weight groups and when
they reduce), the encoder planner (``encoder_plan``: which rank encodes which item, long-short
split, routes), the bubble selection (``bubbles``) and the step's encoder calls
(``encoder_calls``). No process groups here (tests/test_pure_planning.py); the multiplexer that
runs the calls is ``omni.multiplex``."""
from omni.step.program import StepProgram, StepShape, plan_step, step_micro_batches

__all__ = ["StepProgram", "StepShape", "plan_step", "step_micro_batches"]
