"""Pretrain GPT-2 with Megatron tensor parallelism under DeepSpeed.

    deepspeed --num_gpus 2 --module training.pretrain --config configs/gpt2_tiny.yaml [key=value ...]

Overrides are single config keys, e.g. ``parallel.tensor=2 train.iters=50 run.dir=runs/x``.
``--num_gpus`` is DeepSpeed's name; on a CPU machine it is the number of processes (set
DS_ACCELERATOR=cpu to skip accelerator detection). One process without the launcher also works.
"""
from __future__ import annotations

if __name__ == "__main__":  # run as `python -m`: process settings before torch loads
    from training.process_env import configure

    configure()

import os
import sys

from training.cli import launcher_parser, setup_rank_logging
from training.config import ConfigError, check_world, load_config


def main(argv: list[str] | None = None) -> int:
    args = launcher_parser("python -m training.pretrain", __doc__, "run config YAML (see configs/)").parse_args(argv)
    rank = setup_rank_logging()
    try:
        cfg = load_config(args.config, args.overrides)
        check_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before any process group exists
    except ConfigError as e:
        if rank == 0:  # every rank checks; one says it
            print(f"config error: {e}", file=sys.stderr)
        return 2

    import torch.distributed as dist

    from training.distributed import init_distributed
    from training.trainer import Trainer, TrainingAborted

    init_distributed()
    try:
        trainer = Trainer(cfg)
        trainer.train()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except TrainingAborted as e:
        print(f"training aborted: {e}", file=sys.stderr)
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
