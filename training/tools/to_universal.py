"""Convert a ZeRO run's checkpoint to DeepSpeed's universal checkpoint, from which a run continues at another TP
degree, DP size or ZeRO stage (docs/zero.md).

    python -m training.tools.to_universal --checkpoint RUN_DIR [--tag TAG] --out DIR
    deepspeed --num_gpus N --module training.pretrain --config ... run.dir=NEW_RUN_DIR train.load_universal=DIR

A thin wrapper of DeepSpeed's own converter (``deepspeed.checkpoint.ds_to_universal``): each parameter's fp32 master
and Adam moments are gathered from the ZeRO partitions and the TP slices merged by the patterns every checkpoint of
this project carries (``training.universal_info``). DIR is written whole or not at all: the converter writes into a
temporary folder beside DIR, renamed to DIR when it has finished (an interrupted conversion leaves no DIR).

Refused in one line before any work: a DIR that exists and is not empty, a ZeRO-0 checkpoint (the project's own
optimizer state: change its DP size by resuming, its TP/PP with ``training.tools.reshard``), a pipeline-parallel
checkpoint, one saved before the universal info was recorded. A ZeRO-3 checkpoint converts for a ZeRO-3 run (DeepSpeed
reads the model files its own stage names: ``training.universal.check_source``).
"""
from __future__ import annotations

if __name__ == "__main__":  # run as `python -m`: process settings before torch loads
    from training.runtime.process_env import configure

    configure()

import argparse
import contextlib
import io
import logging
import os
import shutil
import sys
from pathlib import Path

from deepspeed.checkpoint import ds_to_universal

from megatron_ds_suite.core.errors import ConfigError
from megatron_ds_suite.core.program import prog as program
from training.checkpoint_reader import checkpoint_dir, model_files, read_client_state
from training.runtime.run_lock import overlapping_input
from training.universal import LATEST_UNIVERSAL
from training.universal_info import UNIVERSAL_INFO_KEY

logger = logging.getLogger("training.tools.to_universal")


def check_source(run_dir: Path, tag: str | None) -> tuple[str, dict]:
    """The tag to convert and its client state; one ConfigError line for a checkpoint the universal format cannot
    carry."""
    tag = model_files(run_dir, tag)[0]
    meta = read_client_state(run_dir, tag)
    cfg, where = meta["config"], f"checkpoint {run_dir}/checkpoints/{tag}"
    if cfg["parallel"]["zero_stage"] == 0:
        raise ConfigError(f"{where} was saved at parallel.zero_stage=0 (the project's own optimizer step, no ZeRO "
                          f"partitions): resume it at any DP size as it is, or change TP/PP with python -m "
                          f"training.tools.reshard")
    if meta["parallel"]["pp"] > 1:
        raise ConfigError(f"{where} was saved with parallel.pipeline={meta['parallel']['pp']}: universal checkpoints "
                          f"are written here for parallel.pipeline=1 only; use python -m training.tools.reshard")
    if UNIVERSAL_INFO_KEY not in meta:
        raise ConfigError(f"{where} was saved before checkpoints recorded how their TP shards merge "
                          f"({UNIVERSAL_INFO_KEY}): resume it and save again, then convert")
    return tag, meta


def convert(run_dir: str | Path, out: str | Path, tag: str | None = None) -> Path:
    """Checkpoint ``tag`` (default: ``latest``) of ``run_dir`` as a universal checkpoint in ``out``
    (``out/<tag>/zero/...``, ``out/latest_universal``); returns ``out``."""
    run_dir, out = Path(run_dir), Path(out)
    overlap = overlapping_input(out, {"--checkpoint": run_dir})
    if overlap:
        raise ConfigError(f"--out {out} {overlap}: choose a new directory outside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not empty: choose a new directory")
    tag, _ = check_source(run_dir, tag)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.converting-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own leftover, never another's
    tmp.mkdir()
    try:
        args = argparse.Namespace(input_folder=str(checkpoint_dir(run_dir) / tag), output_folder=str(tmp / tag),
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=False)
        with contextlib.redirect_stdout(io.StringIO()) as said:  # its progress prints; logged below
            ds_to_universal.main(args)  # writes tmp/<tag>/ and tmp/latest_universal
        logger.debug("%s", said.getvalue())
        if (tmp / LATEST_UNIVERSAL).read_text().strip() != tag:
            raise RuntimeError(f"ds_to_universal wrote no {LATEST_UNIVERSAL} for {tag} in {tmp}")
        if out.exists():
            out.rmdir()  # empty (checked above); a rename does not replace a directory on every platform
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("universal checkpoint of %s/checkpoints/%s written to %s", run_dir, tag, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=program("python -m training.tools.to_universal"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="run directory of a ZeRO-1/2/3 run (checkpoints/latest)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    parser.add_argument("--out", required=True, help="universal checkpoint folder (must not exist or be empty)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(name)s] %(message)s", datefmt="%H:%M:%S")
    try:
        convert(args.checkpoint, args.out, args.tag)
    except (ConfigError, FileNotFoundError) as e:
        print(f"to_universal error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
