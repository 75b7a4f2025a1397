"""The corpus directory: ``corpus.json`` ties tokenizer files and indexed datasets together.

Layout written by ``python -m data_pipeline build`` and read by training and evaluation::

    <root>/corpus.json            manifest (this module)
    <root>/<gpt_prefix>.{bin,idx} one item per document, EOD appended        (optional)
    <root>/<bert_prefix>.{bin,idx} one item per sentence, doc_idx = documents (optional)
    <root>/tokenizer/...          tokenizer files (see copy_tokenizer_files)

``corpus.json``::

    {"format": "megatron-ds-suite-corpus", "version": 1,
     "tokenizer": {<Tokenizer.spec()>, file paths relative to root when inside it},
     "gpt_prefix": "gpt_text_document" | null, "bert_prefix": "bert_text_sentence" | null,
     "extra": {...builder's statistics and settings...}}
"""

from __future__ import annotations

import filecmp
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.errors import SuiteError
from megatron_ds_suite.core.indexed_dataset import MMapIndexedDataset, data_file_path, index_file_path
from megatron_ds_suite.core.tokenizer import Tokenizer, load_tokenizer

MANIFEST_NAME = "corpus.json"
MANIFEST_FORMAT = "megatron-ds-suite-corpus"
MANIFEST_VERSION = 1


class CorpusError(SuiteError):
    """Not a corpus directory, or a manifest that does not match the files (one clear line)."""


def _rel(path: str | Path, root: Path) -> str:
    """``path`` relative to ``root`` when it lies inside it, else absolute."""
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    try:
        return p.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(p.resolve())


def copy_tokenizer_files(tokenizer_spec: dict[str, Any], root: str | Path, subdir: str = "tokenizer") -> dict[str, Any]:
    """Copy every ``*_file`` of a spec into ``root/subdir`` and return the spec pointing at the copies.

    Makes a corpus directory self-contained (movable) instead of depending on files elsewhere.
    """
    dest = Path(root) / subdir
    dest.mkdir(parents=True, exist_ok=True)
    out = dict(tokenizer_spec)
    for k, v in tokenizer_spec.items():
        if k.endswith("_file"):
            src = Path(v)
            target = dest / src.name
            if src.resolve() != target.resolve() and not (target.is_file() and filecmp.cmp(src, target, shallow=False)):
                atomic.copy_file(src, target)  # a full disk mid-copy leaves nothing behind
            out[k] = str(target.resolve())
    return out


def write_manifest(root: str | Path, tokenizer_spec: dict[str, Any], gpt_prefix: str | None, bert_prefix: str | None,
                   extra: dict[str, Any]) -> None:
    """Write ``root/corpus.json`` atomically.  Prefixes and tokenizer file paths are stored relative to
    ``root`` (absolute only when outside it).  The named datasets must already exist."""
    root = Path(root)
    if not root.is_dir():
        raise CorpusError(f"corpus root {str(root)!r} is not a directory")
    prefixes: dict[str, str | None] = {}
    for key, prefix in (("gpt_prefix", gpt_prefix), ("bert_prefix", bert_prefix)):
        if prefix is None:
            prefixes[key] = None
            continue
        p = Path(prefix)
        full = p if p.is_absolute() else root / p
        if not (index_file_path(full).is_file() and data_file_path(full).is_file()):
            raise CorpusError(f"{key} {str(prefix)!r}: {full}.bin/.idx do not exist; build them before the manifest")
        prefixes[key] = _rel(full.resolve(), root)
    spec = {k: (_rel(v, root) if k.endswith("_file") else v) for k, v in tokenizer_spec.items()}
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "tokenizer": spec,
        **prefixes,
        "extra": extra,
    }
    atomic.write_json(root / MANIFEST_NAME, manifest, indent=2, default=str)


@dataclass
class Corpus:
    """A loaded corpus directory.  ``gpt_prefix``/``bert_prefix`` are absolute (or None)."""

    root: Path
    tokenizer: Tokenizer
    gpt_prefix: Path | None
    bert_prefix: Path | None
    manifest: dict[str, Any]

    def gpt_dataset(self) -> MMapIndexedDataset:
        if self.gpt_prefix is None:
            raise CorpusError(f"corpus {self.root} has no GPT dataset (gpt_prefix is null in {MANIFEST_NAME})")
        return MMapIndexedDataset(self.gpt_prefix)

    def bert_dataset(self) -> MMapIndexedDataset:
        if self.bert_prefix is None:
            raise CorpusError(f"corpus {self.root} has no BERT dataset (bert_prefix is null in {MANIFEST_NAME})")
        return MMapIndexedDataset(self.bert_prefix)

    @property
    def extra(self) -> dict[str, Any]:
        return self.manifest.get("extra", {})


def load_corpus(root: str | Path) -> Corpus:  # noqa: C901
    """Read ``root/corpus.json``, load the tokenizer and check that the named datasets exist."""
    root = Path(root)
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise CorpusError(f"{root} has no {MANIFEST_NAME}: build it with python -m data_pipeline build ...")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorpusError(f"{path} is not valid JSON ({e}); rebuild the corpus") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CorpusError(f"{path} is not a corpus manifest (format != {MANIFEST_FORMAT!r})")
    if manifest.get("version") != MANIFEST_VERSION:
        raise CorpusError(f"{path} has manifest version {manifest.get('version')}; this code reads {MANIFEST_VERSION}")
    for key in ("tokenizer", "gpt_prefix", "bert_prefix"):
        if key not in manifest:
            raise CorpusError(f"{path} lacks the {key!r} entry; rebuild the corpus")
    prefixes: dict[str, Path | None] = {}
    for key in ("gpt_prefix", "bert_prefix"):
        v = manifest[key]
        if v is None:
            prefixes[key] = None
            continue
        p = Path(v)
        p = p if p.is_absolute() else root / p
        if not (index_file_path(p).is_file() and data_file_path(p).is_file()):
            raise CorpusError(f"{path} names {key} {v!r} but {p}.bin/.idx are missing")
        prefixes[key] = p.resolve()
    if prefixes["gpt_prefix"] is None and prefixes["bert_prefix"] is None:
        raise CorpusError(f"{path} names neither a GPT nor a BERT dataset")
    try:
        tokenizer = load_tokenizer(manifest["tokenizer"], base_dir=root)
    except ValueError as e:
        raise CorpusError(f"{path}: {e}") from None
    return Corpus(root=root.resolve(), tokenizer=tokenizer, gpt_prefix=prefixes["gpt_prefix"],
                  bert_prefix=prefixes["bert_prefix"], manifest=manifest)
