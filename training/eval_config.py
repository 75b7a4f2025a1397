"""The ``eval:`` section of the run config: lm-evaluation-harness tasks on the model being trained, and its rules
against the model and the parallel layout (each refusal one line)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from megatron_ds_suite.core.config import AtLeastOne, Freezable, NonNegative
from megatron_ds_suite.core.errors import ConfigError
from training.models.config import ModelConfig
from training.parallel_config import ParallelConfig


@dataclass
class EvalConfig(Freezable):
    """lm-evaluation-harness tasks on the model being trained, run with validation (``train.eval_interval`` and
    the end of training) and logged as ``lm_eval/<task>/<metric>`` (evaluation.lm_eval_train; docs/evaluation.md).
    Task names and their data are checked before training starts; a task whose data is on the Hugging Face hub
    needs network access."""

    tasks: list[str] = field(default_factory=list)
    """lm-eval task names, e.g. [lambada_openai_local] (with eval.lambada) or [hellaswag] (online); [] = none."""
    limit: Annotated[int, AtLeastOne] | None = None
    """Only the first N documents of each task (bounds the cost of each evaluation); None = all."""
    num_fewshot: Annotated[int, NonNegative] | None = None
    """Few-shot examples (None = each task's own default); drawn with a fixed seed, the same at every evaluation."""
    batch_size: Annotated[int, AtLeastOne] = 8
    """Sequences per forward pass."""
    lambada: str | None = None
    """Local lambada_test.jsonl: adds the task lambada_openai_local (lm-eval's lambada_openai on this file)."""
    wikitext: str | None = None
    """Local WikiText .tokens/.raw file: adds the task wikitext_local (lm-eval's wikitext on this file)."""


def validate_eval(e: EvalConfig, m: ModelConfig, p: ParallelConfig) -> None:
    """``eval.tasks`` needs a GPT (causal LM) without pipeline or sequence parallelism (the live model runs lm-eval's
    requests whole); its task names and data are checked by evaluation.lm_eval_train before training starts."""
    if not e.tasks:
        return
    if any(not isinstance(t, str) or not t.strip() for t in e.tasks):
        raise ConfigError(f"eval.tasks must be lm-eval task names, got {e.tasks!r}")
    if m.arch == "bert":
        raise ConfigError("eval.tasks (lm-eval) scores a causal LM: remove eval.tasks for a BERT run")
    if p.sequence_parallel and p.tensor > 1:
        raise ConfigError("eval.tasks with parallel.sequence_parallel=true: lm-eval's requests are not split over "
                          "the sequence; remove eval.tasks or set parallel.sequence_parallel=false")
    if p.context > 1:
        raise ConfigError(f"eval.tasks with parallel.context={p.context}: lm-eval's requests are not split over "
                          f"context-parallel ranks; remove eval.tasks or set parallel.context=1")
    if p.pipeline > 1:
        raise ConfigError(f"eval.tasks with parallel.pipeline={p.pipeline}: lm-eval during training runs "
                          "without pipeline parallelism; remove eval.tasks (evaluate the checkpoints with "
                          "python -m evaluation lm-eval) or set parallel.pipeline=1")
