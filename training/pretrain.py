"""Pretrain GPT-2 with Megatron tensor parallelism under DeepSpeed.

    deepspeed --num_gpus 2 --module training.pretrain --config configs/gpt2_tiny.yaml [key=value ...]

Overrides are single config keys, e.g. ``parallel.tensor=2 train.iters=50 run.dir=runs/x``.
``--num_gpus`` is DeepSpeed's name; on a CPU machine it is the number of processes (set
DS_ACCELERATOR=cpu to skip accelerator detection). One process without the launcher also works.
"""
from __future__ import annotations

if __name__ == "__main__":  # run as `python -m`: process settings before torch loads
    from training.runtime.process_env import configure

    configure()

from evaluation.lm_eval_train import LmEvalDuringTraining
from megatron_ds_suite.core.errors import SuiteError
from training.cli import exit_process, launcher_parser, report_error, setup_rank_logging
from training.config import Config, load_config
from training.layout import launch_layout
from training.runtime.launch import run_locked


def main(argv: list[str] | None = None) -> int:
    args = launcher_parser("python -m training.pretrain", __doc__, "run config YAML (see configs/)").parse_args(argv)
    rank = setup_rank_logging()
    try:
        cfg = load_config(args.config, args.overrides)
        launch_layout(cfg)  # before any process group exists
        # eval.tasks: task names, their data and (offline) the hub checked now, not at the first evaluation
        evaluators = [LmEvalDuringTraining(cfg)] if cfg.eval.tasks else []
    except SuiteError as e:
        return report_error(e, rank)  # every rank checks; one says it

    return run_locked(cfg.run.dir, lambda: train(cfg, evaluators))


def train(cfg: Config, evaluators: list | None = None) -> int:
    """The run itself, on every rank, inside the launch skeleton (process group up, run directory claimed):
    the config resolved and frozen (:func:`training.resolve.resolve_run`), then the trainer built from it, with
    ``evaluators`` (eval.tasks' :class:`~evaluation.lm_eval_train.LmEvalDuringTraining`, built by :func:`main`).
    An aborted run (``TrainingAborted``) is exit 3 by the skeleton's table (:func:`training.runtime.launch.run_locked`)."""
    from training.resolve import resolve_run
    from training.trainer import Trainer

    # the same on every rank: train() takes no lock of its own
    Trainer(resolve_run(cfg), evaluators or ()).train(run_dir_locked=True)
    return 0


if __name__ == "__main__":
    exit_process(main())
