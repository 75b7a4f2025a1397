"""RACE fine-tuning maps what its run raises through the launch skeleton's one table, as pretraining does
(training.runtime.launch.run_locked): a bad RACE folder is one line and exit 2, an aborted run one line and exit 3.

Cheap: ``python -m training.finetune_race``'s ``main`` in this process on one gloo rank (an in-memory store, no port),
the pretrained checkpoint's config and metadata given directly; the RACE task itself reads the (missing) folder."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from training import finetune_race
from training.config import config_from_dict
from training.runtime import launch
from training.runtime.distributed import init_distributed
from training.trainer import TrainingAborted

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "question", "answer"]


def _one_rank_group(backend: str | None = None) -> None:
    """The launch skeleton's own start-up, on a default group over an in-memory store (no port to race for)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_distributed("gloo")  # DeepSpeed's comm layer over that group, as every entry point has it


@pytest.fixture
def race_run(tmp_path, monkeypatch):
    """``main``'s config step replaced by a tiny BERT fine-tuning config whose RACE folder does not exist."""
    vocab = tmp_path / "pretrained" / "vocab.txt"
    vocab.parent.mkdir()
    vocab.write_text("\n".join(VOCAB) + "\n")
    cfg = config_from_dict({
        "model": {"arch": "bert", "head": "multiple_choice", "num_layers": 1, "hidden_size": 16,
                  "num_attention_heads": 2, "seq_length": 32, "max_position_embeddings": 32},
        "finetune": {"pretrained": str(vocab.parent), "race_dir": str(tmp_path / "no-race"), "epochs": 1},
        "train": {"micro_batch_size": 1, "global_batch_size": 1, "iters": 1},
        "run": {"dir": str(tmp_path / "ft")}})
    meta = {"tokenizer": {"kind": "wordpiece", "vocab_file": "vocab.txt"}}
    monkeypatch.setattr(finetune_race, "load_finetune_config", lambda path, overrides: (cfg, meta))
    monkeypatch.setattr(launch, "init_distributed", _one_rank_group)
    for key, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29500")):  # restored after the test (init_distributed sets what is missing)
        monkeypatch.setenv(key, value)
    return tmp_path


def test_a_race_data_error_is_one_line_and_exit_2(race_run, capsys):
    assert finetune_race.main(["--config", "race.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: RACE ") and str(race_run / "no-race") in err[0], err
    assert not dist.is_initialized()  # torn down on the error path


def test_an_aborted_race_run_is_one_line_and_exit_3(race_run, monkeypatch, capsys):
    def aborted(cfg, meta, run_dir_locked=False):
        raise TrainingAborted("3 consecutive steps skipped for fp16 overflow")

    monkeypatch.setattr(finetune_race, "train_race", aborted)
    assert finetune_race.main(["--config", "race.yaml"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["training aborted: 3 consecutive steps skipped for fp16 overflow"]
    assert not dist.is_initialized()
