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

from training.cli import launcher_parser, setup_rank_logging
from training.config import ConfigError, load_config
from training.layout import derive_layout


def main(argv: list[str] | None = None) -> int:
    args = launcher_parser("python -m training.pretrain", __doc__, "run config YAML (see configs/)").parse_args(argv)
    rank = setup_rank_logging()
    try:
        cfg = load_config(args.config, args.overrides)
        derive_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before any process group exists
    except ConfigError as e:
        if rank == 0:  # every rank checks; one says it
            print(f"config error: {e}", file=sys.stderr)
        return 2

    import torch.distributed as dist

    from training.runtime.distributed import init_distributed
    from training.safe_load import CheckpointError
    from training.trainer import Trainer, TrainingAborted

    init_distributed()
    try:
        trainer = Trainer(cfg)
        trainer.train()
    except CheckpointError as e:  # unsafe, truncated or missing checkpoint files, a bad `latest`
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
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
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
