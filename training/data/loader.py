"""Training data: a GPT dataset over an indexed corpus, and the Megatron sample order per DP rank.

Sources (config ``data``):
- ``corpus``: a directory from ``python -m data_pipeline build`` (tokenizer + indexed dataset);
- ``text_files``: plain text tokenized once into RUN_DIR/data (documents = blank-line blocks) with
  the tokenizer named in ``data.tokenizer``, cached by content digest;
- ``prefixes``: Megatron ``.bin/.idx`` datasets blended by weight (:mod:`training.data.blending`).

Order: for iteration k and micro-batch m, DP rank d reads samples
``k*G + m*(mb*dp) + d*mb + [0, mb)`` of the shuffled dataset (G = global batch, mb = micro-batch), so a
run with DP=2 and one with DP=1 and twice the gradient accumulation see the same samples per step.
All TP ranks of a DP replica read the same samples (reads are memory-mapped, no broadcast needed).
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_ds_suite.core.corpus import load_corpus
from megatron_ds_suite.core.errors import ConfigError
from megatron_ds_suite.core.indexed_dataset import dataset_exists
from megatron_ds_suite.core.indexed_dataset_builder import MMapIndexedDatasetBuilder, best_dtype
from megatron_ds_suite.core.tokenizer import Tokenizer, load_tokenizer
from training.config import Config
from training.data.gpt_dataset import build_gpt_datasets
from training.data.sample_order import micro_batch_positions
from training.data.token_range import check_token_ids
from training.runtime.distributed import rank0_first

logger = logging.getLogger(__name__)
LINES_PER_DOC = 50


@dataclass
class DataSources:
    tokenizer: Tokenizer
    prefix: Path
    tokenizer_spec: dict
    tokenizer_base: Path | None
    blend: tuple[list[float], list[Path]] | None = None
    """data.prefixes: (normalised weights, prefixes); ``prefix`` is then the first of them."""


def resolve_sources(cfg: Config) -> DataSources:
    """Tokenizer and dataset prefix (cheap: no tokenization). Raises ConfigError on a bad path."""
    d = cfg.data
    if d.corpus is not None:
        try:
            corpus = load_corpus(d.corpus)
        except (ValueError, OSError) as e:
            raise ConfigError(f"data.corpus: {e}") from None
        if corpus.gpt_prefix is None:
            raise ConfigError(f"data.corpus={d.corpus} has no GPT dataset; build it with a GPT tokenizer")
        return DataSources(corpus.tokenizer, corpus.gpt_prefix, corpus.manifest["tokenizer"], corpus.root)
    if d.prefixes:  # Megatron .bin/.idx datasets blended by weight (training.data.blending)
        from training.data.blending import parse_prefixes

        weights, prefixes = parse_prefixes(d.prefixes, d.split_convention)
        if not d.tokenizer:
            raise ConfigError("data.tokenizer must name the tokenizer the data.prefixes were written with, e.g. "
                              "{kind: gpt2_bpe, vocab_file: ..., merges_file: ...}")
        try:
            tok = load_tokenizer(d.tokenizer)
        except (ValueError, OSError) as e:
            raise ConfigError(f"data.tokenizer: {e}") from None
        return DataSources(tok, prefixes[0], tok.spec(), None, blend=(weights, prefixes))
    missing = [f for f in d.text_files if not Path(f).is_file()]
    if missing:
        raise ConfigError(f"data.text_files: {missing[0]} does not exist")
    if not d.tokenizer:
        raise ConfigError("data.tokenizer must name a tokenizer for data.text_files, e.g. "
                          "{kind: gpt2_bpe, vocab_file: ..., merges_file: ...}")
    try:
        tok = load_tokenizer(d.tokenizer)
    except (ValueError, OSError) as e:
        raise ConfigError(f"data.tokenizer: {e}") from None
    digest = hashlib.sha256(json.dumps({"files": [str(Path(f).resolve()) for f in d.text_files],
                                        "content": [text_file_sha256(f) for f in d.text_files],
                                        "tok": tok.spec()}, sort_keys=True).encode()).hexdigest()[:16]
    prefix = Path(cfg.run.dir) / "data" / f"text_{digest}"
    return DataSources(tok, prefix, tok.spec(), None)


def text_file_sha256(path: str | Path) -> str:
    """sha256 of a ``data.text_files`` entry (the cache key: a file edited in place is re-tokenized),
    after checking it is non-empty UTF-8 text: a binary file is refused, never decoded with replacements."""
    data = Path(path).read_bytes()
    if not data.lstrip(b"\xef\xbb\xbf").strip():
        raise ConfigError(f"data.text_files: {path} is empty (no text to train on): remove it from the list")
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, data.index(b"\0"), data.index(b"\0") + 1, "NUL byte")
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.text_files: {path} is not UTF-8 text ({e.reason} at byte {e.start}): a binary file? "
                          f"convert it to UTF-8 text or remove it") from None
    return hashlib.sha256(data).hexdigest()


def tokenize_text_files(files: list[str], tok: Tokenizer, prefix: Path) -> None:
    """Blank-line blocks of each file become documents, EOD appended; written atomically."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = MMapIndexedDatasetBuilder(prefix, best_dtype(tok.vocab_size))
    with builder:
        for f in files:
            text = Path(f).read_text(encoding="utf-8").lstrip("\ufeff")  # checked by text_file_sha256
            blocks = [b.strip() for b in re.split(r"\n\s*\n", text) if b.strip()]
            if len(blocks) < 2:  # no blank lines: documents of LINES_PER_DOC lines
                lines = text.splitlines()
                blocks = ["\n".join(lines[i:i + LINES_PER_DOC]) for i in range(0, len(lines), LINES_PER_DOC)]
                blocks = [b for b in blocks if b.strip()]
            for ids in tok.encode_batch(blocks):
                builder.add_item(np.asarray(ids + [tok.eod]))
                builder.end_document()
        builder.finalize()


def build_datasets(cfg: Config, src: DataSources, num_samples: tuple[int, int, int]):
    """Train/valid/test GPT datasets; rank 0 builds index maps (and text tokens) first, others load.
    Every dataset's token ids are checked against the tokenizer first (training.data.token_range); an
    error rank 0 meets is raised by every rank (training.runtime.distributed.rank0_first)."""
    cache = Path(cfg.run.dir) / "data" / "index_cache"

    def build():
        if cfg.data.text_files and not dataset_exists(src.prefix):
            logger.info("tokenizing %d text file(s) into %s", len(cfg.data.text_files), src.prefix)
            tokenize_text_files(cfg.data.text_files, src.tokenizer, src.prefix)
        convention = cfg.data.split_convention
        sle = cfg.data.separate_last_epoch
        if src.blend is not None:
            from training.data.blending import build_blended_datasets

            return build_blended_datasets(*src.blend, cfg.data.split, num_samples, cfg.model.seq_length,
                                          cfg.train.seed, cache, src.tokenizer.vocab_size, sle is not False, convention)
        where = "data.corpus" if cfg.data.corpus is not None else "data.text_files"
        check_token_ids(src.prefix, src.tokenizer.vocab_size, cache, where)
        return build_gpt_datasets(src.prefix, cfg.data.split, num_samples, cfg.model.seq_length,
                                  cfg.train.seed, cache_dir=cache, convention=convention,
                                  separate_last_epoch=sle if sle is not None else convention == "megatron_core")

    return rank0_first(build)


class BatchSampler:
    """Megatron's sample order for one DP rank, resumable from ``consumed_samples``."""

    def __init__(self, dataset, micro_batch: int, dp_size: int, dp_rank: int, global_batch: int):
        self.dataset, self.mb, self.dp, self.rank, self.gb = dataset, micro_batch, dp_size, dp_rank, global_batch

    def micro_batches(self, consumed_samples: int):
        """The ``gas`` micro-batches (tokens [mb, s], labels [mb, s]) of the step that starts at
        ``consumed_samples``."""
        n = len(self.dataset)
        for positions in micro_batch_positions(consumed_samples, self.mb, self.dp, self.rank, self.gb):
            rows = np.stack([self.dataset[p % n] for p in positions])
            t = torch.from_numpy(rows.astype(np.int64))
            yield t[:, :-1].contiguous(), t[:, 1:].contiguous()
