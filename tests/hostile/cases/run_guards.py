"""What guards a training run: the run lock (live and stale), DeepSpeed config typos, ``init_from`` pointing at
itself, a corpus or a broken run, launcher runs, RACE fine-tuning inputs, NaN/inf hyper-parameters, Ctrl-C.
"""
from __future__ import annotations

from tests.hostile.case import case
from tests.hostile.commands import deepspeed_runner_traceback, free_port, resume_cmd, train_cmd
from tests.hostile.damage import damage_bin, snap_changed, snap_save
from tests.hostile.fixtures import copy_of, fixture, train_args
from tests.hostile.probe import Holder


@case("training", "stale_lock", "a lock left by a killed run (pid gone)", "ok")
def _(p, tmp):
    cmd = resume_cmd(p, tmp)
    holder = Holder(p, tmp / "run")
    holder.proc.kill()
    holder.proc.wait()
    return cmd


@case("training", "deepspeed_typo_top", "`deepspeed.wall_clock_breakdwn=true` (typo)")
def _(p, tmp):
    return train_cmd(p, tmp, "deepspeed.wall_clock_breakdwn=true")


@case("training", "deepspeed_typo_nested", "`deepspeed.zero_optimization.overlap_com=true` (typo)")
def _(p, tmp):
    return train_cmd(p, tmp, "deepspeed.zero_optimization={\"overlap_com\": true}")


@case("training", "deepspeed_wrong_type", "`deepspeed.steps_per_print=often`")
def _(p, tmp):
    return train_cmd(p, tmp, "deepspeed.steps_per_print=often")


@case("training", "init_from_self", "`train.init_from` = run.dir")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    return train_cmd(p, tmp, f"train.init_from={run}")


def _unchanged_source(p, tmp, res):
    if not (tmp / "src").is_dir():
        return "the source run was deleted"
    return "the source run was written into" if snap_changed(tmp, "src") else None


@case("training", "init_from_inside_run_dir", "`train.init_from` a run inside run.dir (run.dir its ancestor)",
      check=_unchanged_source)
def _(p, tmp):
    copy_of(p, "run", tmp / "src")
    snap_save(tmp, "src")
    return train_args(p, tmp, fixture(p, "corpus"), 2, **{"train.init_from": str(tmp / "src")})


@case("training", "init_from_ancestor_of_run_dir", "`run.dir` inside the `train.init_from` run",
      check=_unchanged_source)
def _(p, tmp):
    copy_of(p, "run", tmp / "src")
    snap_save(tmp, "src")
    return train_args(p, tmp / "src" / "finetuned", fixture(p, "corpus"), 2, **{"train.init_from": str(tmp / "src")})


@case("training", "init_from_missing", "`train.init_from` names no run")
def _(p, tmp):
    return train_cmd(p, tmp, f"train.init_from={tmp / 'none'}")


@case("training", "init_from_corpus", "`train.init_from` a corpus folder")
def _(p, tmp):
    return train_cmd(p, tmp, f"train.init_from={fixture(p, 'corpus')}")


@case("training", "init_from_binary_latest", "`train.init_from` a run with a binary latest")
def _(p, tmp):
    src = copy_of(p, "run", tmp / "src")
    (src / "checkpoints" / "latest").write_bytes(b"\x80\x81\xfe\x00")
    return train_cmd(p, tmp, f"train.init_from={src}")


@case("training", "pipeline_without_ranks", "`parallel.pipeline=2` in a single process")
def _(p, tmp):
    return train_cmd(p, tmp, "parallel.pipeline=2")


@case("training", "wandb_unreachable", "`run.wandb.mode=online` with the W&B server unreachable", "ok", timeout=150)
def _(p, tmp):
    p.extra_env[str(tmp)] = {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "x" * 40}
    return train_cmd(p, tmp, "run.wandb.enabled=true", "run.wandb.mode=online", "run.wandb.project=probe")


@case("training", "tp2_token_ids_out_of_range", "TP=2 under the launcher, a token id 65000 in the .bin",
      timeout=300)
def _(p, tmp):
    c = damage_bin(p, tmp, "out_of_range")
    args = train_args(p, tmp / "run", c, 2, **{"parallel.tensor": "2"})
    return ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module", *args[2:]]


@case("training", "finetune_race_into_pretrained_subfolder", "RACE `run.dir` inside `finetune.pretrained`",
      check=_unchanged_source)
def _(p, tmp):
    copy_of(p, "run", tmp / "src")
    snap_save(tmp, "src")
    return ["python", "-m", "training.finetune_race", "--config", p.configs("race.yaml"),
            f"finetune.pretrained={tmp / 'src'}", f"run.dir={tmp / 'src' / 'race'}", "parallel.tensor=1"]


@case("training", "finetune_race_from_gpt", "RACE fine-tuning of a GPT-2 checkpoint")
def _(p, tmp):
    return ["python", "-m", "training.finetune_race", "--config", p.configs("race.yaml"),
            f"finetune.pretrained={fixture(p, 'run')}", f"run.dir={tmp / 'race'}", "parallel.tensor=1"]


@case("training", "finetune_race_missing_pretrained", "`finetune.pretrained` names no run")
def _(p, tmp):
    return ["python", "-m", "training.finetune_race", "--config", p.configs("race.yaml"),
            f"finetune.pretrained={tmp / 'none'}", f"run.dir={tmp / 'race'}", "parallel.tensor=1"]


@case("training", "lr_nan", "`optimizer.lr=.nan` (passed `lr > 0` checks: NaN compares false)")
def _(p, tmp):
    return train_args(p, tmp / "run", fixture(p, "corpus"), **{"optimizer.lr": ".nan"})


@case("training", "lr_inf", "`optimizer.lr=.inf`")
def _(p, tmp):
    return train_args(p, tmp / "run", fixture(p, "corpus"), **{"optimizer.lr": ".inf"})


@case("training", "layernorm_eps_negative", "`model.layernorm_epsilon=-1e-5` (the NaN loss was blamed on the lr)")
def _(p, tmp):
    return train_args(p, tmp / "run", fixture(p, "corpus"), **{"model.layernorm_epsilon": "-1e-5"})


@case("training", "adam_eps_nan", "`optimizer.eps=.nan`")
def _(p, tmp):
    return train_args(p, tmp / "run", fixture(p, "corpus"), **{"optimizer.eps": ".nan"})


@case("training", "nested_yaml_override", "`deepspeed.x=` a value nested 20,000 lists deep")
def _(p, tmp):
    return train_args(p, tmp / "run", fixture(p, "corpus"), **{"deepspeed.x": "[" * 20000 + "]" * 20000})


def _lock_released(p, tmp, res):
    said = [x for x in res.out.splitlines() if x.startswith("interrupted:")]
    if len(said) != 1:
        return f"{len(said)} 'interrupted:' lines"
    lock = tmp / "run" / ".lock"
    return None if not lock.exists() or lock.read_text() == "" else "a rank was killed before it released the run's lock"


@case("training", "ctrl_c_group_deepspeed", "Ctrl-C to the process group of a TP=2 run under the deepspeed launcher",
      timeout=300, check=_lock_released, interrupt="run/checkpoints/latest", settle=1.0,
      foreign=deepspeed_runner_traceback)
def _(p, tmp):
    args = train_args(p, tmp / "run", fixture(p, "corpus"), 100000, **{"parallel.tensor": "2"})
    return ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module", *args[2:]]
