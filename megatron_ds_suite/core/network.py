"""Loopback ports for a rendezvous (torch.distributed's ``MASTER_PORT``, ``deepspeed --master_port``)."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
