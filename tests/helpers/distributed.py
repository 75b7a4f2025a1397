"""Test-side names of the shared multi-process helpers (megatron_ds_suite.app.testing) and the shared data path."""
from __future__ import annotations

import os

from megatron_ds_suite.app.testing import free_port, run_distributed

SHARED_DATA = (os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data"))

__all__ = ["SHARED_DATA", "free_port", "run_distributed"]
