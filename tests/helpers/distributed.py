"""Test-side names of the shared multi-process helpers (the spawner training.runtime.spawn, a free port) and the
shared data path."""
from __future__ import annotations

import os

from megatron_ds_suite.core.network import free_port
from training.runtime.spawn import run_distributed

SHARED_DATA = (os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data"))

__all__ = ["SHARED_DATA", "free_port", "run_distributed"]
