"""lm-evaluation-harness tasks on the model being trained: ``eval.tasks`` (GPT-NeoX's ``eval_tasks``).

    eval: {tasks: [lambada_openai_local], lambada: ../shared/data/eval/lambada/lambada_test.jsonl, limit: 500}

:class:`LmEvalDuringTraining` is built by the entry point (``training.pretrain``) from the run config before any
process group exists: the task names, the local task files (``eval.lambada``, ``eval.wikitext``, as
``python -m evaluation lm-eval --lambada/--wikitext``) and, offline, the tasks whose data is on the Hugging Face hub
are checked then, in one line (:func:`evaluation.lm_eval_run.task_manager`), not at the first evaluation. The
trainer calls it wherever it validates (``train.eval_interval`` and the end) with the live model: the same lm-eval
model as the checkpoint command (:class:`evaluation.lm_eval_model.SuiteLM`) over a scorer of the module itself, no
checkpoint round trip, so its numbers equal ``python -m evaluation lm-eval`` on a checkpoint saved at that
iteration. The model runs in eval mode without autograd and is put back in the mode it was in; the random
streams lm-eval seeds (Python, NumPy, torch CPU and CUDA) are put back too, so a run with ``eval.tasks`` trains
exactly as one without. Under tensor parallelism every rank of the TP group runs the same requests (each data
parallel replica runs them too and gets the same numbers); pipeline parallelism and sequence parallelism are
refused by the config (``training.eval_config.validate_eval``).

Results: ``{"<task>/<metric>": value}``, written by the trainer as the ``lm_eval`` event of ``metrics.jsonl``
(W&B/TensorBoard: ``lm_eval/<task>/<metric>``) and one log line from rank 0. lm-eval's ``metric,filter`` keys
become ``metric`` (filter ``none``) or ``metric_filter``; standard errors are not computed (``bootstrap_iters=0``).
"""
from __future__ import annotations

import logging
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from evaluation.lm_eval_run import evaluate_tasks, task_manager
from evaluation.scoring import gpt2_scorer
from training.config import Config
from training.parallel.state import ParallelState
from training.parallel.utils import vocab_range
from training.runtime import device as tdev

logger = logging.getLogger("training")


@contextmanager
def kept_rng_state() -> Iterator[None]:
    """Put back the Python, NumPy, torch CPU and CUDA random states on exit (lm-eval seeds all of them)."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def flat_metrics(results: dict) -> dict[str, float]:
    """lm-eval's ``results`` (``{task: {"acc,none": v, "acc_stderr,none": "N/A", "alias": ...}}``) as
    ``{"task/acc": v}``: numbers only, standard errors left out, a filter other than ``none`` kept as a suffix."""
    out: dict[str, float] = {}
    for task, values in results.items():
        for key, v in values.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            out[f"{task}/{metric if filt == 'none' else f'{metric}_{filt}'}"] = float(v)
    return out


class LmEvalDuringTraining:
    """The ``eval.tasks`` of a run config, checked when built; called with the live model at each validation."""

    name = "lm_eval"
    """The event's name in metrics.jsonl, and the prefix of its metrics in W&B/TensorBoard."""

    def __init__(self, cfg: Config):
        self.ecfg = cfg.eval
        self.max_length = cfg.model.positions
        # the local task files live as long as this object (lm-eval reads them at each evaluation)
        self.folder = tempfile.TemporaryDirectory(prefix="lm_eval_tasks_")
        self.manager = task_manager(Path(self.folder.name), list(self.ecfg.tasks), self.ecfg.lambada,
                                    self.ecfg.wikitext, options=("eval.lambada", "eval.wikitext"))

    def __call__(self, model: torch.nn.Module, tokenizer, ps: ParallelState, iteration: int) -> dict[str, float]:
        """The tasks' metrics on ``model`` (this rank's TP shard of a GPT; collective over its TP group); ``{}`` on
        the ranks where lm-eval keeps no results (every rank runs the requests)."""
        from evaluation.lm_eval_model import SuiteLM  # loads lm-eval

        start = time.perf_counter()
        padded = int(getattr(model, "padded_vocab_size"))
        tp, group = ps.dims.tp, (ps.tp_group if ps.dims.tp > 1 else None)
        scorer = gpt2_scorer(model, tokenizer.vocab_size, self.max_length, tdev.module_device(model),
                             vocab_start=vocab_range(padded, ps.tp_rank, tp)[0], tp_group=group)
        lm = SuiteLM(scorer, tokenizer, f"training iteration {iteration}", batch_size=self.ecfg.batch_size)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), kept_rng_state():
                res = evaluate_tasks(lm, self.manager, list(self.ecfg.tasks), self.ecfg.num_fewshot, self.ecfg.limit)
        finally:
            model.train(was_training)
        if res is None:  # lm-eval returns its results where LOCAL_RANK is 0 only; the writer is global rank 0's
            return {}
        metrics = flat_metrics(res["results"])
        if not dist.is_initialized() or dist.get_rank() == 0:
            shown = " | ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            logger.info("lm-eval at iteration %d | %s | %.1f s", iteration, shown, time.perf_counter() - start)
        return metrics
