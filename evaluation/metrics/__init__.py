"""`evaluate` metric modules kept inside the project, loaded from their local folder (no network).

Each metric lives in ``evaluation/metrics/<name>/<name>.py`` (the layout ``evaluate.load(path)``
expects) and is loaded with :func:`load_metric`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

METRICS_DIR = Path(__file__).resolve().parent
NAMES = ("perplexity_adjusted", "lambada_accuracy", "race_accuracy")


def load_metric(name: str) -> Any:
    """``evaluate.load`` of the local module ``name`` (one of :data:`NAMES`)."""
    import evaluate

    if name not in NAMES:
        raise ValueError(f"unknown metric {name!r}; local metrics: {', '.join(NAMES)}")
    return evaluate.load(str(METRICS_DIR / name))
