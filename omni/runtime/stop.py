"""Stopping a run on Ctrl-C (SIGINT) or SIGTERM without losing its work (docs/fault-tolerance.md,
"Stopping a run").

The first signal only raises a flag. The trainer folds that flag into the step's one all-reduce
(the losses and the gradient norm already travel together), so every rank learns it from the
same step's sum, stops after that same step and saves a checkpoint; a rank that got no signal
stops too, and no collective is added. The run then ends with ``RunStopped`` (one line, exit
status 128 + the signal: 130 for SIGINT, 143 for SIGTERM). A second signal stops at once
(``StopNow``), and the line says which steps that loses.

Duplicates: a scheduler that signals every process of a job (SLURM's ``scancel``, a container
runtime) and ``torchrun`` forwarding the same signal reach a rank twice within milliseconds.
A signal within ``SAME_REQUEST_S`` of the first is taken as the same request, not a second one.

Data workers: a process forked while the handler is installed (the data loader's workers) is
moved to a process group of its own. A signal sent to the training process's group (the
terminal's Ctrl-C, torchrun forwarding a signal to each worker's group) then reaches the
training process alone, which ends its workers itself once the checkpoint is saved. Left in the
group, torch's data workers die on a SIGTERM that is not their parent's, and the loader turns
that into an error in the middle of the stop. Such a child gets the default handlers back: a
signal sent to it alone (its pool's or loader's shutdown, or a scheduler signalling every
process) ends it as usual; with the parent's handler it raised a flag nobody read, and a pool
waited forever for it.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM)
SAME_REQUEST_S = 1.0
_installed = 0  # how many StopOnSignal scopes are open in this process (its main thread)


def _own_group_while_installed() -> None:
    """In a child just forked while a stop handler is installed: a process group of its own (the
    signals sent to the training process's group stay with it), and the default handlers back:
    a signal sent to the child itself (a pool's or a data loader's shutdown) ends it as it would
    have, rather than raising a flag nobody reads (a pool's terminate then waited forever)."""
    if _installed:
        try:
            os.setpgid(0, 0)
        except OSError:
            pass  # already a group leader
        for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
            try:
                signal.signal(sig, default)
            except ValueError:  # forked from a thread other than the main one: its handlers are the parent's
                pass


os.register_at_fork(after_in_child=_own_group_while_installed)


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class RunStopped(Exception):
    """The run stopped on a signal; the message is the one line that says where and how to go
    on. Not a UserError: it ends with the signal's conventional exit status."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class StopNow(KeyboardInterrupt):
    """Raised by the handler on a second signal, wherever the main thread is."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StopOnSignal:
    """While entered (main thread only), SIGINT and SIGTERM request a stop instead of ending
    the process. ``announce``: print one line when the first signal arrives (the main rank);
    ``below_bar``: start it on a new line (a progress bar holds the current one)."""

    def __init__(self, announce: bool = True, below_bar: bool = False, on_request=None):
        """``on_request(signum)``: called once, from the handler, when the first signal comes."""
        self.announce = announce
        self.on_request = on_request
        self.lead = "\n" if below_bar else ""
        self.signum: int | None = None  # the first signal, once one came
        self.second: int | None = None  # the signal that asked to stop at once
        self._first_at = 0.0
        self._pid = os.getpid()
        self._previous: dict[int, object] = {}
        self._closing = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> "StopOnSignal":
        global _installed
        if threading.current_thread() is threading.main_thread():
            self._pid, self._closing = os.getpid(), False
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            _installed += 1
        return self

    def __exit__(self, *exc) -> None:
        global _installed
        self._closing = True  # a signal arriving while the handlers are put back raises nothing
        previous, self._previous = self._previous, {}
        if previous:
            _installed -= 1
        for sig, handler in previous.items():
            # None: the handler before was not set from Python (a library's, in C), which Python
            # cannot put back; the default then, rather than leaving ours behind
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def _handle(self, signum: int, frame) -> None:
        # A forked child inherits this handler with the rest of the process; a signal sent to it
        # alone (its own group keeps the group-wide ones away) leaves the decision to the parent.
        if os.getpid() != self._pid or self._closing:
            return
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            if self.announce:
                again = "Ctrl-C again" if signum == signal.SIGINT else f"a second {signal_name(signum)}"
                # os.write, not print: the handler may run in the middle of a print to stderr
                # (the progress bar), and a buffered stream refuses to be entered twice.
                _write(f"{self.lead}omni: {signal_name(signum)}: finishing this step, saving a checkpoint, then "
                       f"stopping ({again} stops at once, losing the steps since the last checkpoint)\n")
            if self.on_request is not None:
                self.on_request(signum)
            return
        if now - self._first_at < SAME_REQUEST_S:
            return  # the same request, delivered twice
        self.second = signum
        raise StopNow(signum)


def _write(text: str) -> None:
    try:
        os.write(2, text.encode())
    except OSError:
        pass


def resume_hint(resume: str, checkpoint: Path | None) -> str:
    """What running the same command again does, given ``checkpoint.resume`` and the newest
    complete checkpoint."""
    if checkpoint is None:
        return "no checkpoint yet: the same command starts again from step 0"
    step = int(checkpoint.name.rsplit("_", 1)[1])
    if resume == "never":
        return f"run it again with checkpoint.resume=auto to resume from step {step} ({checkpoint})"
    if resume != "auto":
        return f"run it again with checkpoint.resume=auto (not {resume}) to resume from step {step} ({checkpoint})"
    return f"run the same command again to resume from step {step}"


def stopped_message(signum: int, step: int, saved: Path | None, newest: Path | None, resume: str,
                    why_not: str = "", during: bool = False) -> str:
    """The last line of a run stopped after ``step`` (``during``: in it): the checkpoint it saved
    (``saved``), or why it saved none (``why_not``) and the newest one there is (``newest``)."""
    head = f"stopped {'during' if during else 'at'} step {step} ({signal_name(signum)})"
    if saved is not None:
        return f"{head}: checkpoint saved to {saved}; {resume_hint(resume, saved)}"
    return f"{head} without a checkpoint ({why_not}); {resume_hint(resume, newest)}"


def interrupted_message(first: int, second: int, step: int, newest: Path | None, resume: str) -> str:
    """The last line of a run stopped at once by a ``second`` signal during ``step``: what is lost."""
    how = f"{signal_name(first)} twice" if first == second else f"{signal_name(first)}, then {signal_name(second)}"
    since = int(newest.name.rsplit("_", 1)[1]) if newest is not None else 0
    lost = ("nothing is lost" if step <= since else f"step {step} is lost" if step == since + 1
            else f"steps {since + 1}-{step} are lost")
    return f"interrupted during step {step} ({how}), without saving: {lost}; " \
           f"{resume_hint(resume, newest)}"


# A rank that makes no progress this long after a stop was asked for ends at once (below)...
STOP_GRACE_MIN_S = 10.0
# ... unless it is in one of these phases of the trainer's (omni/runtime/trainer.py), which last
# as long as they last: a save (the stop's own is after the agreement), a validation pass.
SLOW_PHASES = ("checkpoint save", "validation")


def exit_if_stuck(signum: int, progress, stopped, grace_s: float, rank: int) -> threading.Thread:
    """After the first signal, a thread that ends the process (status 128 + ``signum``, one
    line) when the rank makes no progress for ``grace_s``: no new phase of the step
    (``progress()`` -> (step, phase, monotonic start of the phase)) while the stop is not yet
    agreed (``stopped()`` false). torchrun signals every rank when one has failed; a rank stuck in
    a collective with the dead one (or in a hang) would otherwise hold on, its handler having
    taken the signal, until torchrun kills it 30 s later. A healthy rank reaches the step's end
    and the agreed stop within a few step times (``grace_s``: the caller's bound)."""
    def watch():
        asked = time.monotonic()
        while not stopped():
            time.sleep(0.25)
            step, phase, since = progress()
            if phase in SLOW_PHASES:  # a save or validation in progress takes its own time
                continue
            if not stopped() and time.monotonic() - max(since, asked) > grace_s:
                _write(f"omni: {signal_name(signum)}: rank {rank} made no progress for {grace_s:.0f} s since "
                       f"(step {step}, {phase}; another rank may have ended): stopping without a checkpoint\n")
                os._exit(128 + signum)

    thread = threading.Thread(target=watch, name="omni-stop-grace", daemon=True)
    thread.start()
    return thread
