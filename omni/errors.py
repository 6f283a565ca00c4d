"""User-facing errors: the message names the culprit and the fix, and the CLI prints it as
one line without a traceback."""
from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix (bad config value, missing file, unknown plugin)."""


class ConfigError(UserError):
    """A configuration that cannot work; the message names the key and a valid choice."""
