"""Loading Hugging Face ``datasets`` without running code from what is loaded.

``datasets.load_dataset`` on a local ``.py`` file, or on a folder holding a loading script, imports and runs
that script (``datasets`` < 4 did so by default; 4.x refuses scripts). Corpus sources and evaluation sets
come from users and downloads, so every load goes through :func:`load_hf_dataset`: a local script is refused
with one line before ``datasets`` sees it, and hub code is never trusted (``trust_remote_code=False`` where
the installed ``datasets`` still has that switch). Data files (parquet, jsonl, arrow, ``save_to_disk``
folders) load as before.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from megatron_ds_suite.core.errors import SuiteError


class UnsafeDatasetError(SuiteError):
    """A dataset given as a loading script (code), which this project never runs."""


def local_scripts(target: str | Path) -> list[Path]:
    """The Python files ``datasets`` would run for ``target``: the file itself, or a folder's top-level ``*.py``."""
    p = Path(target)
    if p.is_file():
        return [p] if p.suffix == ".py" else []
    if p.is_dir():
        return sorted(p.glob("*.py"))
    return []


def check_no_script(target: str | Path) -> None:
    scripts = local_scripts(target)
    if scripts:
        raise UnsafeDatasetError(
            f"dataset {str(target)!r} is a loading script ({scripts[0]}), which would run code: give the data "
            f"files instead (a folder of parquet/jsonl/csv files, or a datasets.save_to_disk folder)")


def load_hf_dataset(name: str, config: str | None = None, **kwargs: Any):
    """``datasets.load_dataset(name, config, **kwargs)`` refusing local scripts and remote code."""
    import datasets

    check_no_script(name)
    if "trust_remote_code" in inspect.signature(datasets.load_dataset).parameters:  # datasets < 4
        kwargs.setdefault("trust_remote_code", False)
    return datasets.load_dataset(name, config, **kwargs)
