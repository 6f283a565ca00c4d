"""A faster Triton interpreter for the suite (``TRITON_INTERPRET=1`` runs the kernels on the CPU).

Triton 3.x's interpreter re-patches ``triton.language`` on every call of a ``@triton.jit``
function from inside a kernel (``InterpretedFunction.__call__`` -> ``_patch_lang``, ~0.7 ms),
although the kernel's launch has already patched the same module for the kernel's whole run.
Omni's kernels call small helpers in their inner loops (``omni/kernels/_attention_triton.py``), so
this re-patching was 28% of an interpreted training step (a single-process reference run of the
4-layer test model: 14.2 s, 10.2 s without it, every output bit-identical). Here a helper of
``omni.kernels`` (whose ``tl`` is the module the launch patched) runs without it; Triton's own
library functions, whose globals name other modules, keep theirs. Nothing changes on a GPU.
"""
from __future__ import annotations

import os


def install() -> None:
    """Patch the interpreter (a no-op without TRITON_INTERPRET=1, or on a Triton without the
    internals this relies on)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    cls = getattr(interpreter, "InterpretedFunction", None)
    if cls is None or getattr(cls, "_omni_shared_patch", False) or not hasattr(cls, "rewrite"):
        return
    default = cls.__call__

    def call(self, *args, **kwargs):
        if not getattr(self.fn, "__module__", "").startswith("omni.kernels."):
            return default(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as the interpreter reports a failing device function
            raise interpreter.InterpreterError(repr(e)) from e

    cls.__call__ = call
    cls._omni_shared_patch = True


install()
