import sys

from training.runtime.process_env import configure


def _main() -> int:
    configure()  # before torch loads (see training/runtime/process_env.py)
    from evaluation.cli import main

    return main()


sys.exit(_main())
