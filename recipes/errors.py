"""Which exceptions are the user's to fix (printed as one line) rather than Omni bugs, and
how to phrase them."""
from __future__ import annotations

import difflib
import json
import os
import re
import sys
import time

from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from dataloading.errors import DataError
from omni.errors import UserError
from parallel.layout import LayoutError
from omni.models.config import EncoderSlot
from recipes.schema import OmniConfig

USER_ERRORS: tuple[type[BaseException], ...] = (
    UserError,
    DataError,
    LayoutError,
    HydraException,
    OmegaConfBaseException,
    FileNotFoundError,
)


def _schema_keys(parts: list[str]) -> list[str] | None:
    """Keys of the schema node at `parts` (encoder slots have the EncoderSlot keys)."""
    node = OmegaConf.structured(OmniConfig)
    for i, part in enumerate(parts):
        if parts[:1] == ["encoders"] and i == 1:
            node = OmegaConf.structured(EncoderSlot)
            continue
        if not OmegaConf.is_dict(node) or part not in node:
            return None
        node = node[part]
    return [str(k) for k in node.keys()] if OmegaConf.is_dict(node) else None


def _unknown_key_message(override: str) -> str:
    key = override.split("=", 1)[0].lstrip("+~")
    parts = key.split(".")
    # The first component that does not exist is the misspelt one.
    for depth in range(len(parts)):
        valid = _schema_keys(parts[:depth])
        if valid is None:
            break
        if parts[depth] not in valid and not (depth == 1 and parts[0] == "encoders"):
            prefix = ".".join(parts[:depth] + [""])
            if not valid and not override.startswith("+"):
                # A free mapping (optim.groups): its entries are the user's own keys, and
                # Hydra adds a key that is not in the config only with a +.
                return (f"unknown config key '{key}': '{prefix[:-1]}' holds your own entries, and Hydra adds a new "
                        f"one only with a leading +: write +{key}=...")
            close = difflib.get_close_matches(parts[depth], valid, n=1)
            hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
            return f"unknown config key '{key}'; {hint}valid keys under '{prefix or '<root>'}': {', '.join(valid)}"
    return f"unknown config key '{key}'; see `omni train --cfg job` for the keys"


def one_line(exc: BaseException) -> str:
    cause = exc.__cause__
    if isinstance(exc, ConfigCompositionException) and isinstance(cause, OmegaConfBaseException):
        m = re.search(r"(?:Could not override|Error merging override) '?([^' ]+)'?", str(exc))
        if m and isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            return _unknown_key_message(m.group(1))
        if m:
            return f"{m.group(1)}: {str(cause).splitlines()[0]}"
    text = str(exc).split("Config search path:")[0]
    # Hydra/OmegaConf messages span lines (key, full key, object type): keep them on one.
    text = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return text or type(exc).__name__


def last_line(line: str) -> None:
    """Print the line a run ends with (``omni: error: ...``, ``omni: stopped ...``) once per job.

    Under torchrun every rank reaches the same config error, and every rank stops at the same
    step: rank 0 prints the line, the others stay quiet. Each rank also writes its line into
    torchelastic's error file (``TORCHELASTIC_ERROR_FILE``, set by torchrun for every worker):
    the failure report torchrun prints when a worker exits non-zero then shows the line as that
    rank's "traceback" (its root cause last), instead of a link to torch's docs. So a line that
    only one rank has (a data error, a timeout) still reaches the screen through that report. A
    worker cannot keep torchrun from printing the report; docs/fault-tolerance.md shows it. Other
    launchers set no error file: every rank prints."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # The shape torchelastic's ErrorHandler writes: the report shows "py_callstack" if
        # present, else the message; the timestamp picks the root cause.
        record = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
        try:
            with open(error_file, "w") as f:
                json.dump(record, f)
        except OSError:
            error_file = None  # no report will carry it: print it
    if not error_file or int(os.environ.get("RANK", "0")) == 0:
        # One write: print's separate newline could land after another process's output.
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
