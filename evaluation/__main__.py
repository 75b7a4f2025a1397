import sys

from training.runtime.process_env import configure

configure()  # before torch loads (see training/runtime/process_env.py)

from evaluation.cli import main  # noqa: E402

sys.exit(main())
