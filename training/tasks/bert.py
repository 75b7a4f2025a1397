"""BERT pretraining as a trainer task: MLM + SOP over a sentence-level corpus.

A :class:`training.tasks.protocol.Task`; the trainer handles DeepSpeed, precision, metrics
and checkpoints. Batches are dicts of int64 tensors (``training.data.bert_data.collate``); the loss is
``mlm + sop`` and both parts are logged (``mlm_loss``, ``sop_loss``).

Sample order: as the GPT task (Megatron's sampler): DP rank d of a step starting at ``consumed``
reads samples ``consumed + m*(mb*dp) + d*mb + [0, mb)`` for micro-batch m; all TP ranks of a replica
read the same samples (each builds them from the memory-mapped corpus, deterministically).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from megatron_ds_suite.core.corpus import load_corpus
from megatron_ds_suite.core.errors import ConfigError
from training.config import Config
from training.data.bert_data import BertDataError, BertDataset, BertVocab, MaskingConfig, collate, usable_documents
from training.data.gpt_dataset import split_boundaries
from training.data.sample_order import micro_batch_positions
from training.data.token_range import check_token_ids
from training.models.bert import BertModel, bert_loss
from training.models.bert_pipe import build_bert_pipe, pipe_batch
from training.parallel.state import ParallelState
from training.runtime.distributed import rank0_first
from training.tasks.protocol import Task, batch_to_device

logger = logging.getLogger("training")


def check_bert_config(cfg: Config) -> None:
    """Ranges of the BERT-only keys (one line each)."""
    b = cfg.bert
    for name, v in (("bert.masked_lm_prob", b.masked_lm_prob), ("bert.short_seq_prob", b.short_seq_prob),
                    ("bert.mask_token_prob", b.mask_token_prob), ("bert.random_token_prob", b.random_token_prob)):
        if not 0.0 <= v <= 1.0:
            raise ConfigError(f"{name} must be in [0, 1], got {v}")
    if b.mask_token_prob + b.random_token_prob > 1.0:
        raise ConfigError(f"bert.mask_token_prob + bert.random_token_prob = "
                          f"{b.mask_token_prob + b.random_token_prob} exceeds 1")
    if b.max_ngram < 1:
        raise ConfigError(f"bert.max_ngram must be >= 1, got {b.max_ngram}")
    if cfg.model.num_tokentypes < 2:
        raise ConfigError(f"model.num_tokentypes={cfg.model.num_tokentypes}: BERT pretraining uses two segments (2)")
    if cfg.model.seq_length < 8:
        raise ConfigError(f"model.seq_length={cfg.model.seq_length} is too short for [CLS] A [SEP] B [SEP]")


def masking_config(cfg: Config) -> MaskingConfig:
    b = cfg.bert
    return MaskingConfig(b.masked_lm_prob, b.mask_token_prob, b.random_token_prob, b.max_ngram, b.whole_word)


class BertTask(Task):
    """Masked-LM + sentence-order prediction over ``data.corpus``'s BERT (sentence) dataset."""

    def __init__(self, cfg: Config, ps: ParallelState, dp: int):
        self.cfg, self.ps, self._dp = cfg, ps, dp
        check_bert_config(cfg)
        d = cfg.data
        if d.corpus is None:
            raise ConfigError("BERT needs a sentence-split corpus: set data.corpus to a directory built with "
                              "`python -m data_pipeline build ... tokenizer.flavor=bert dataset.bert=true` "
                              "(data.text_files has no sentence boundaries)")
        try:
            corpus = load_corpus(d.corpus)
        except (ValueError, OSError) as e:
            raise ConfigError(f"data.corpus: {e}") from None
        if corpus.bert_prefix is None:
            raise ConfigError(f"data.corpus={d.corpus} has no BERT (sentence-level) dataset: rebuild it with "
                              f"dataset.bert=true tokenizer.flavor=bert")
        self.tokenizer = corpus.tokenizer
        try:
            self.vocab = BertVocab.from_tokenizer(self.tokenizer)
        except BertDataError as e:
            raise ConfigError(f"data.corpus={d.corpus}: {e}") from None
        self.indexed = corpus.bert_dataset()
        docs = np.arange(self.indexed.num_documents)
        usable, skipped = usable_documents(self.indexed.doc_idx, docs)
        if len(usable) == 0:
            raise ConfigError(f"data.corpus={d.corpus}: none of its {len(docs)} documents has two or more sentences "
                              "(no sentence boundaries): rebuild it with dataset.bert=true")
        if skipped and (ps is None or ps.rank == 0):
            logger.warning("BERT: %d of %d documents have fewer than two sentences and are skipped", skipped, len(docs))
        self.skipped_documents = skipped
        self.tokens_per_sample = cfg.model.seq_length
        self.masking = masking_config(cfg)

    # ---- data ------------------------------------------------------------------------------------
    def _datasets(self, num_samples: tuple[int, int]):
        cfg = self.cfg
        bounds = split_boundaries(cfg.data.split, self.indexed.num_documents, cfg.data.split_convention)
        cache = Path(cfg.run.dir) / "data" / "index_cache"
        check_token_ids(self.indexed.prefix, self.tokenizer.vocab_size, cache, "data.corpus")
        out = []
        for k, (name, n) in enumerate(zip(("train", "valid"), num_samples)):
            docs = np.arange(bounds[k], bounds[k + 1])
            if n <= 0 or len(docs) == 0 or len(usable_documents(self.indexed.doc_idx, docs)[0]) == 0:
                if name == "train":
                    raise ConfigError(f"the train split {cfg.data.split!r} of {cfg.data.corpus} has no document "
                                      "with two or more sentences")
                logger.warning("BERT %s split is empty: no validation", name)
                out.append(None)
                continue
            out.append(BertDataset(self.indexed, docs, n, cfg.model.seq_length, self.vocab, self.masking,
                                   cfg.bert.short_seq_prob, cfg.train.seed, name, cache_dir=cache))
        return out

    def build_data(self) -> None:
        t = self.cfg.train
        eval_runs = (t.iters // t.eval_interval if t.eval_interval else 0) + 1
        sizes = (max(t.iters, 1) * t.global_batch_size, eval_runs * t.eval_iters * t.global_batch_size)
        # rank 0 checks the ids and builds the maps first, the others load them; its errors are everyone's
        self.train_ds, self.valid_ds = rank0_first(lambda: self._datasets(sizes))

    def _micro_batches(self, ds, consumed_samples: int):
        t = self.cfg.train
        n = len(ds)
        pipe = self.cfg.parallel.pipeline > 1  # the pipeline engine loads (inputs, labels) tuples
        for positions in micro_batch_positions(consumed_samples, t.micro_batch_size, self._dp, self.ps.dp_rank,
                                               t.global_batch_size):
            batch = collate([ds[p % n] for p in positions])
            yield pipe_batch(batch) if pipe else batch

    def micro_batches(self, consumed_samples: int):
        return self._micro_batches(self.train_ds, consumed_samples)

    def valid_micro_batches(self, i: int):
        if self.valid_ds is None:
            return None
        return self._micro_batches(self.valid_ds, i * self.cfg.train.global_batch_size)

    # ---- model and loss --------------------------------------------------------------------------
    def build_model(self, padded_vocab: int):
        par = self.cfg.parallel
        if par.pipeline > 1:
            return build_bert_pipe(self.cfg.model, padded_vocab, self.ps, seed=self.cfg.train.seed,
                                   sequence_parallel=par.sequence_parallel, schedule=par.pipeline_schedule,
                                   virtual_pipeline=par.virtual_pipeline)
        return BertModel(self.cfg.model, padded_vocab, self.ps.tp_group, seed=self.cfg.train.seed,
                         sequence_parallel=self.cfg.parallel.sequence_parallel)

    def loss(self, engine: torch.nn.Module, batch) -> tuple[torch.Tensor, dict]:
        batch = batch_to_device(batch, engine)
        lm_loss, sop_logits = engine(batch["text"], batch["types"], batch["padding_mask"], batch["labels"],
                                     batch["loss_mask"])
        return bert_loss(lm_loss, sop_logits, batch["is_random"])
