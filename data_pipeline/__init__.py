"""Corpus building: raw documents → cleaned, length-filtered, near-deduplicated, tokenized corpus.

Python API::

    from data_pipeline import build
    from data_pipeline.config import load_config
    out_dir = build(load_config("configs/data/default.yaml", ["workers=2"]))

Command line: ``python -m data_pipeline build --config configs/data/<name>.yaml [key=value ...]``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


def build(config: Any, overrides: list[str] | None = None, force: bool = False) -> Path:
    """Build the corpus described by ``config`` (a :class:`~data_pipeline.config.BuildConfig` or a
    YAML path) and return the output directory (which holds ``corpus.json``)."""
    from data_pipeline.config import BuildConfig, load_config
    from data_pipeline.stages import build as _build

    cfg = config if isinstance(config, BuildConfig) else load_config(config, overrides)
    out, _ = _build(cfg, force=force)
    return out


__all__ = ["build"]
