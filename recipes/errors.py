"""Which exceptions are the user's to fix (printed as one line) rather than Omni bugs."""
from __future__ import annotations

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from dataloading.errors import DataError
from omni.errors import UserError
from parallel.layout import LayoutError

USER_ERRORS: tuple[type[BaseException], ...] = (
    UserError,
    DataError,
    LayoutError,
    HydraException,
    OmegaConfBaseException,
    FileNotFoundError,
)


def one_line(exc: BaseException) -> str:
    """Hydra/OmegaConf messages span lines (key, full key, object type): keep them on one."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return text or type(exc).__name__
