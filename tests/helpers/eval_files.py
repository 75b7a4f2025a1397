"""The evaluation inputs the main job derives, computed with its own code, for the ``--limit`` tests."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace


def main_job_cut(src: Path, limit: int, run: Path, kind: str = "wikitext") -> Path:
    """The file the main job (megatron_ds_suite.app.main_job) evaluates for ``eval.<task>.limit_lines/limit = limit`` (its own code)."""
    from megatron_ds_suite.app.main_job.job import MainJob

    path, ident, source = MainJob._eval_input(SimpleNamespace(run=run), "wikitext103", str(src), None,
                                                       "test", limit, kind)
    assert source == src.resolve() and ident[1] == limit and path != source
    return path
