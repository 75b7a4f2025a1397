"""``eval.tasks`` refusals, each one line before training starts: what the config alone decides (pipeline and
sequence parallelism, BERT, bad ranges), then what the lm-eval evaluator checks when the entry point builds it
(unknown task, a hub task offline, a missing local file). The end-to-end run is
tests/parallel/test_lm_eval_during_training.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ds_suite.core.errors import ConfigError, SuiteError
from training.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "gpt2_tiny.yaml"
LOCAL = ["eval.tasks=[lambada_openai_local]", "eval.lambada=lambada_test.jsonl"]


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("overrides, says", [
    (["parallel.pipeline=2", "parallel.tensor=1"], "parallel.pipeline=1"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=false"),
    (["model.arch=bert"], "BERT"),
    (["eval.limit=0"], "eval.limit"),
    (["eval.batch_size=0"], "eval.batch_size"),
    (["eval.tasks=['']"], "eval.tasks must be lm-eval task names"),
    (["parallel.context=2", "parallel.tensor=1"], "or set parallel.context=1"),
])
def test_config_refuses(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, LOCAL + overrides)
    assert says in _one_line(err)


def test_config_accepts_tasks_with_tensor_parallelism():
    cfg = load_config(TINY, LOCAL + ["eval.limit=3"])  # gpt2_tiny: parallel.tensor=2
    assert cfg.eval.tasks == ["lambada_openai_local"] and cfg.eval.limit == 3 and cfg.parallel.tensor == 2
    assert load_config(TINY, ["parallel.pipeline=2", "parallel.tensor=1"]).eval.tasks == []  # off: PP is fine


@pytest.mark.parametrize("overrides, says", [
    (["eval.tasks=[hellaswag]"], "task(s) hellaswag read their data from the Hugging Face hub, which is unreachable"),
    # offline, a name that is not a local task is taken for one of lm-eval's hub tasks (not indexed: ~20 s)
    (["eval.tasks=[no_such_task]"], "task(s) no_such_task read their data from the Hugging Face hub"),
    (["eval.tasks=[lambada_openai_local]"], "use the local tasks (eval.lambada FILE: lambada_openai_local"),
    (["eval.tasks=[lambada_openai_local]", "eval.lambada=/nonexistent/lambada_test.jsonl"],
     "eval.lambada /nonexistent/lambada_test.jsonl does not exist"),
])
def test_the_evaluator_refuses_before_training(overrides, says, monkeypatch):
    pytest.importorskip("lm_eval")
    from evaluation.lm_eval_train import LmEvalDuringTraining

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SuiteError) as err:
        LmEvalDuringTraining(load_config(TINY, overrides))
    assert says in _one_line(err)
