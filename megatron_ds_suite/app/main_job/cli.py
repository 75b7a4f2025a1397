"""Command line of the main job: ``python -m megatron_ds_suite.app.main_job [--config ...] [--force STAGE] [key=value ...]``."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from megatron_ds_suite.app.main_job import job
from megatron_ds_suite.app.main_job.config import ConfigError, load_main_config
from megatron_ds_suite.app.main_job.job import ROOT, MainJob


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_ds_suite.app.main_job", description=job.__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/main/default.yaml", help="main-job YAML (configs/main/)")
    ap.add_argument("--force", action="append", default=[], metavar="STAGE",
                    help="re-run this stage even if finished (repeatable; 'all' for every stage)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    ap.add_argument("overrides", nargs="*", help="main-config overrides, e.g. train.set.train.iters=50")
    args = ap.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    config_path = str(Path(args.config).resolve())
    os.chdir(ROOT)  # every relative path inside configs and overrides is relative to the repository root

    install_signal_handlers()
    try:
        cfg = load_main_config(config_path, args.overrides)
        if args.quiet:
            cfg.progress = False
        main_job = MainJob(cfg, args.config, args.overrides, set(args.force))
        return main_job.execute()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP (an ssh session that drops) behave like Ctrl-C: the running stage's process
    group (its own session, so the hangup never reaches it) is stopped by ``run_logged`` and the
    orchestrator exits 130 with its state kept; rerunning resumes. Without this a hangup killed the
    orchestrator alone and left training running, unlocked, for a rerun to overlap."""
    def on_term(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
