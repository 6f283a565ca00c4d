"""Where a Ray started by the data plane listens (``data.ray_bind``).

A Ray instance accepts work from whoever reaches its ports, and its actors unpickle what they are
sent, so one the data plane starts on its own (``data.backend=ray`` without ``data.ray_address``)
listens on loopback only: ``ray_bind="127.0.0.1"`` (the default). To let actors on other nodes
join it, set ``ray_bind`` to this host's address on the network they share, or ``"0.0.0.0"`` for
Ray's own choice (the host's routable address, every interface). Joining a cluster that is already
running (``data.ray_address`` or ``$RAY_ADDRESS``) is not affected: that cluster's own settings
decide.

Ray (2.60) rewrites a loopback ``_node_ip_address`` to the host's routable address unless it runs in
its single-machine mode (``ray_constants.ENABLE_RAY_CLUSTER`` off, as on macOS/Windows); that switch
is turned off for the duration of ``ray.init`` only. Afterwards the node's address is checked: if
this Ray version came up elsewhere anyway, it is shut down and a one-line config error says so.
"""
from __future__ import annotations

import contextlib
import ipaddress

from dataloading.errors import DataError

__all__ = ["LOOPBACK", "EVERYWHERE", "check_bind", "start_local_ray"]

LOOPBACK = "127.0.0.1"
EVERYWHERE = "0.0.0.0"


def check_bind(bind: str | None) -> str:
    """``data.ray_bind`` as an IP address string, or a one-line config DataError naming it."""
    value = str(bind).strip() if bind is not None else ""
    if value == "localhost":
        return LOOPBACK
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise DataError(f"data.ray_bind={bind!r} is not an IP address; use {LOOPBACK!r} (this machine only, the "
                        f"default), {EVERYWHERE!r} (reachable from other nodes) or one of this host's addresses",
                        kind="config") from None


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


@contextlib.contextmanager
def _single_machine_mode():
    """Ray's single-machine switch, off while the block runs (so a loopback node address stays)."""
    try:
        from ray._private import ray_constants
    except ImportError:
        ray_constants = None
    if ray_constants is None or not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        yield  # a Ray without the switch: the address check after init still guards
        return
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def start_local_ray(ray, bind: str, **init_kwargs):
    """Start a new local Ray (``address="local"``) whose node listens on ``bind``; returns
    ``ray.init``'s context."""
    bind = check_bind(bind)
    if bind == EVERYWHERE:
        return ray.init(address="local", **init_kwargs)
    if not _is_loopback(bind):
        return ray.init(address="local", _node_ip_address=bind, **init_kwargs)
    with _single_machine_mode():
        context = ray.init(address="local", _node_ip_address=bind, **init_kwargs)
    node_ip = ray.util.get_node_ip_address()
    if not _is_loopback(node_ip):
        ray.shutdown()
        raise DataError(f"data.ray_bind={bind!r}: the local Ray (version {ray.__version__}) came up on {node_ip} "
                        f"instead of loopback, so it was stopped; set data.ray_bind to {node_ip!r} or "
                        f"{EVERYWHERE!r} to accept that, or start Ray yourself and pass data.ray_address",
                        kind="config")
    return context
