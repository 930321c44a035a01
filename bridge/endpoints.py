"""Endpoint arithmetic for data-parallel ranks (docs/protocol.md section 1, "Data parallelism").

Rank r of an engine publishes on the configured port + r for both sockets; ``inproc://name`` and
``ipc://path`` become ``inproc://name_dp{r}`` / ``ipc://path_dp{r}``.
"""

from __future__ import annotations

import re

from .errors import ConfigError

_TCP = re.compile(r"^(tcp|udp)://(.+):(\d+)$")


def for_rank(endpoint: str, rank: int) -> str:
    """The endpoint of ``rank`` given rank 0's."""
    if rank == 0:
        return endpoint
    m = _TCP.match(endpoint)
    if m:
        port = int(m.group(3)) + rank
        if port > 65535:
            raise ConfigError([f"{endpoint}: rank {rank} would use port {port} (> 65535)"])
        return f"{m.group(1)}://{m.group(2)}:{port}"
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    raise ConfigError([f"{endpoint}: cannot derive the endpoint of rank {rank} (expected tcp://host:port, ipc:// or inproc://)"])


def publisher_binds(endpoint: str) -> bool:
    """True when an engine given ``endpoint`` binds it (so the bridge connects)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
