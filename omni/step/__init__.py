"""The shape of a training step as one pure program (issue 39): how many micro-batches every rank
runs, how long each row is, every pipeline rank's actions with the cuts and tail cuts where
encoder work joins in (pp = 1 included), where each chunk's encoder backward can run and the
later ranks' bubble windows. ``plan_step`` decides it once per step from plain numbers; the
trainer pads its rows to it, the pipeline executor runs it, the multiplexer plans its encoder
calls against it and the simulator costs it. No process groups here (tests/test_pure_planning.py)."""
from omni.step.program import StepProgram, StepShape, plan_step, step_micro_batches

__all__ = ["StepProgram", "StepShape", "plan_step", "step_micro_batches"]
