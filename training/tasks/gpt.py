"""GPT-2 pretraining as a trainer task: causal language modelling over a GPT dataset.

See :class:`training.tasks.protocol.Task` for what a task provides; batches are (tokens, labels) host
tensors in Megatron's sample order (:mod:`training.data.sample_order`).
"""
from __future__ import annotations

import torch

from training.config import Config
from training.data.context_documents import context_part
from training.data.documents import DocumentMasks, masked_mean
from training.data.loader import BatchSampler, build_datasets, resolve_sources
from training.models.gpt2 import GPTModel
from training.models.gpt2_pipe import build_gpt2_pipe
from training.parallel.context import ContextParallel
from training.parallel.state import ParallelState
from training.tasks.protocol import Task, batch_to_device


class GPTTask(Task):
    """Causal language modelling over a GPT dataset (samples of seq_len+1 tokens)."""

    def __init__(self, cfg: Config, ps: ParallelState, dp: int):
        self.cfg, self.ps = cfg, ps
        self.src = resolve_sources(cfg)
        self.tokenizer = self.src.tokenizer
        self.tokens_per_sample = cfg.model.seq_length
        self._dp = dp
        d = cfg.data  # packed documents kept apart (Megatron's options; training/data/documents.py)
        self.documents = DocumentMasks.from_options(self.tokenizer.eod, d.reset_position_ids, d.reset_attention_mask,
                                                    d.eod_mask_loss)
        par = cfg.parallel  # context parallelism: each CP rank its part of every sample (training/parallel/context.py)
        self.context = ContextParallel(ps.cp_group, par.context_impl) if par.context > 1 else None

    def build_data(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        eval_runs = (t.iters // t.eval_interval if t.eval_interval else 0) + 1
        train_ds, valid_ds, _ = build_datasets(
            cfg, self.src, (max(t.iters, 1) * t.global_batch_size, eval_runs * t.eval_iters * t.global_batch_size, 0))
        dp_rank = self.ps.dp_rank
        self.sampler = BatchSampler(train_ds, t.micro_batch_size, self._dp, dp_rank, t.global_batch_size)
        self.valid_sampler = (BatchSampler(valid_ds, t.micro_batch_size, self._dp, dp_rank, t.global_batch_size)
                              if valid_ds is not None else None)

    def build_model(self, padded_vocab: int):
        if self.cfg.parallel.pipeline > 1:
            par = self.cfg.parallel
            return build_gpt2_pipe(self.cfg.model, padded_vocab, self.ps, seed=self.cfg.train.seed,
                                   sequence_parallel=par.sequence_parallel, schedule=par.pipeline_schedule,
                                   virtual_pipeline=par.virtual_pipeline)
        return GPTModel(self.cfg.model, padded_vocab, self.ps.tp_group, seed=self.cfg.train.seed,
                        sequence_parallel=self.cfg.parallel.sequence_parallel, context=self.context)

    def micro_batches(self, consumed_samples: int):
        return self.sampler.micro_batches(consumed_samples)

    def valid_micro_batches(self, i: int):
        if self.valid_sampler is None:
            return None
        return self.valid_sampler.micro_batches(i * self.cfg.train.global_batch_size)

    def loss(self, engine: torch.nn.Module, batch) -> tuple[torch.Tensor, dict]:
        tokens, labels = batch_to_device(batch, engine)
        if self.context is not None:  # the rank's tokens at their global positions; the whole sequence's mean
            part = context_part(self.context, self.documents, tokens, labels)
            losses = engine(part.tokens, part.labels, positions=part.positions, attn_mask=part.attn_mask)
            return self.context.loss(losses, part.loss_mask), {}
        if self.documents is None:
            return engine(tokens, labels).mean(), {}
        positions, mask, loss_mask = self.documents.of(tokens)
        return masked_mean(engine(tokens, labels, positions=positions, attn_mask=mask), loss_mask), {}


def make_task(cfg: Config, ps: ParallelState, dp: int) -> Task:
    if cfg.model.arch in ("gpt", "gpt2"):                               # gpt2: the old name of gpt
        return GPTTask(cfg, ps, dp)
    if cfg.model.arch == "bert":
        from training.tasks.bert import BertTask  # noqa: PLC0415 - BERT pulls in its own data code

        return BertTask(cfg, ps, dp)
    raise ValueError(f"unknown model.arch {cfg.model.arch!r}")
