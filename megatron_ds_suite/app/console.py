"""Console commands (``[project.scripts]`` in pyproject.toml): each one prepares the process, then runs the
same ``main()`` as ``python -m <module>``.

The preparation (:func:`training.runtime.process_env.configure`) must happen before torch is imported, which is
why these are functions here and not the modules' own ``main``: importing the stage modules imports torch.
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
from pathlib import Path

from megatron_ds_suite.configs_lookup import bundled_config, list_configs
from megatron_ds_suite.core.program import set_command
from training.runtime.process_env import configure


def _run(module: str, func: str = "main", prepare: bool = True) -> None:
    set_command(os.path.basename(sys.argv[0]) or None)  # usage lines name the command that was typed
    if prepare:
        configure()
    main = getattr(importlib.import_module(module), func)
    sys.exit(main())


def data() -> None:
    """``megatron-ds-data`` = ``python -m data_pipeline``."""
    _run("data_pipeline.__main__", prepare=False)


def pretrain() -> None:
    """``megatron-ds-pretrain`` = ``python -m training.pretrain``."""
    _run("training.pretrain")


def finetune_race() -> None:
    """``megatron-ds-finetune-race`` = ``python -m training.finetune_race``."""
    _run("training.finetune_race")


def evaluate() -> None:
    """``megatron-ds-eval`` = ``python -m evaluation``."""
    _run("evaluation.cli")


def export_hf() -> None:
    """``megatron-ds-export-hf`` = ``python -m training.tools.export_hf``."""
    _run("training.tools.export_hf")


def reshard() -> None:
    """``megatron-ds-reshard`` = ``python -m training.tools.reshard``."""
    _run("training.tools.reshard")


def to_universal() -> None:
    """``megatron-ds-to-universal`` = ``python -m training.tools.to_universal``."""
    _run("training.tools.to_universal")


def plan() -> None:
    """``megatron-ds-plan`` = ``python -m training.plan``."""
    _run("training.plan.cli", prepare=False)  # the package re-exports nothing: main lives in its cli module


def configs(argv: list[str] | None = None) -> None:
    """``megatron-ds-configs list | show NAME | copy NAME DEST``: the bundled default configs."""
    p = argparse.ArgumentParser(prog="megatron-ds-configs", description=configs.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="names of the bundled configs")
    s = sub.add_parser("show", help="print one")
    s.add_argument("name")
    c = sub.add_parser("copy", help="copy one to edit it")
    c.add_argument("name")
    c.add_argument("dest", help="file to write, or an existing folder (the config keeps its name there)")
    c.add_argument("--force", action="store_true", help="replace DEST if it exists (an edited copy is lost)")
    args = p.parse_args(argv)
    if args.cmd == "list":
        print("\n".join(list_configs()))
        sys.exit(0)
    path = bundled_config(args.name)
    if path is None:
        print(f"error: no bundled config {args.name!r}; `megatron-ds-configs list` shows them", file=sys.stderr)
        sys.exit(2)
    if args.cmd == "show":
        sys.stdout.write(path.read_text())
    else:
        dest = Path(args.dest)
        if dest.is_dir():
            dest = dest / path.name
        if dest.exists() and not args.force:
            print(f"error: {dest} exists (perhaps a copy you edited): choose another name, or pass --force to replace "
                  f"it", file=sys.stderr)
            sys.exit(2)
        if not dest.parent.is_dir():
            print(f"error: the folder {dest.parent} does not exist: create it first", file=sys.stderr)
            sys.exit(2)
        tmp = dest.with_name(f".{dest.name}.tmp")
        shutil.copyfile(path, tmp)
        tmp.replace(dest)  # whole or not at all
        print(f"wrote {dest}")
    sys.exit(0)
