"""Loopback ports for a rendezvous (torch.distributed's ``MASTER_PORT``, ``deepspeed --master_port``), and whether
the Hugging Face hub can be reached."""
from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hub_offline() -> bool:
    """Whether the Hugging Face libraries were told to stay offline (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``)."""
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def network_reachable(host: str = "huggingface.co", port: int = 443, timeout: float = 3.0) -> bool:
    """A TCP connection to ``host`` opens within ``timeout`` seconds (never, when :func:`hub_offline`)."""
    if hub_offline():
        return False
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
