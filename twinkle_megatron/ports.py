"""A free local TCP port, for ``MASTER_PORT`` of multi-process runs on one machine (the launcher in
:mod:`twinkle_megatron.train`, the tests' and benchmarks' workers)."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on at ``127.0.0.1`` right now (the OS picks it; another process may
    still take it before the caller binds, so callers that retry should ask again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
