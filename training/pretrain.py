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

import os
import sys

from training.cli import launcher_parser, report_error, setup_rank_logging
from megatron_ds_suite.core.errors import SuiteError
from training.config import load_config
from training.layout import derive_layout


def main(argv: list[str] | None = None) -> int:
    args = launcher_parser("python -m training.pretrain", __doc__, "run config YAML (see configs/)").parse_args(argv)
    rank = setup_rank_logging()
    try:
        cfg = load_config(args.config, args.overrides)
        derive_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before any process group exists
    except SuiteError as e:
        return report_error(e, rank)  # every rank checks; one says it

    import torch.distributed as dist

    from training.runtime import run_lock
    from training.runtime.distributed import init_distributed
    from training.trainer import Trainer, TrainingAborted

    init_distributed()
    lock = None
    try:
        # one run per run.dir, claimed before any data, model or engine exists (a collective: every rank
        # calls it here, right after the default group, so the order of collectives is the same on all
        # ranks). A refused launch then builds nothing, writes nothing into the busy run directory and
        # leaves only the default group, which destroy_process_group() below fully stops: once DeepSpeed
        # has been initialised, its module globals (deepspeed.utils.groups.mpu, activation checkpointing's
        # mpu/mp_group) keep the TP/DP/PP gloo groups and their C++ threads alive past
        # destroy_process_group() until interpreter finalisation, where tearing them down could abort
        # the process ("terminate called without an active exception") instead of exiting with 2.
        lock = run_lock.acquire_for_rank0(cfg.run.dir, dist.get_rank() == 0)
        trainer = Trainer(cfg)
        trainer.train(run_dir_locked=True)  # the same on every rank: train() takes no lock of its own
    except run_lock.RunDirBusy as e:  # every rank learnt it from rank 0 at once; one says it
        return report_error(e, dist.get_rank())
    except SuiteError as e:  # bad config, unsafe/truncated/missing checkpoint files, a bad `latest`, bad data
        return report_error(e)  # from whichever rank met it
    except TrainingAborted as e:
        print(f"training aborted: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # Ctrl-C / SIGINT from the launcher: checkpoints are atomic, latest is intact
        print("interrupted: the newest complete checkpoint is kept; rerun the same command to resume", file=sys.stderr)
        return 130
    except OSError as e:  # disk full, permissions: the checkpoint being written is discarded, `latest` kept
        print(f"error: {e.strerror or e}: {e.filename or cfg.run.dir} (check free disk space and permissions); the "
              f"newest complete checkpoint is kept, rerun the same command to resume", file=sys.stderr)
        return 1
    finally:
        if lock is not None:  # rank 0's claim (an empty file: a clean exit)
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
