"""What every ``python -m training.*`` entry point run by the deepspeed launcher starts with."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from megatron_ds_suite.core.errors import SuiteError
from megatron_ds_suite.core.program import prog as program
from training.layout import launched_world_size
from training.runtime import orphan_guard


def launcher_parser(prog: str, description: str | None, config_help: str) -> argparse.ArgumentParser:
    """``--config YAML``, the launcher's ``--local_rank`` (hidden) and ``section.key=value`` overrides."""
    parser = argparse.ArgumentParser(prog=program(prog), description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help=config_help)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser


def setup_rank_logging() -> int:
    """INFO on rank 0, warnings elsewhere, DeepSpeed's own chatter at WARNING; returns this rank."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(name)s] %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    for noisy in ("DeepSpeed", "deepspeed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    orphan_guard.exit_when_gone(orphan_guard.launcher_runner_pid())  # never train on after `deepspeed` is gone
    return rank


def report_error(error: SuiteError, rank: int = 0) -> int:
    """Print a :class:`SuiteError` as its one line (``config error: ...``, ``checkpoint error: ...``) on
    stderr, from rank 0 only (every rank checks the same config; one says it); returns the exit code 2.
    An error marked ``agreed`` (every rank raised rank 0's, training.runtime.distributed.rank0_first) is
    printed by rank 0 alone whatever ``rank`` says."""
    if getattr(error, "agreed", False):
        return 2
    if rank == 0:
        print(error.one_line(), file=sys.stderr)
    return 2


def exit_process(code: int) -> None:
    """``sys.exit(code)``, except that a failed distributed command (``code`` != 0, its one line already printed)
    leaves without interpreter finalisation (``os._exit`` after flushing the logs and standard streams): once
    DeepSpeed has been initialised, its module globals keep the process groups alive until then, and their
    destruction there can abort the process ("terminate called without an active exception"), which turns the
    launcher's exit code into 250 (seen on a rank stopped by a truncated checkpoint shard, under load). Every
    file a failed run writes is written atomically before this point; a successful run exits normally."""
    if code and launched_world_size() != 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
