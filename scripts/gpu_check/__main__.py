"""``python -m scripts.gpu_check``: the GPU smoke suite (:mod:`scripts.gpu_check.cli`)."""
import sys

from scripts.gpu_check.cli import main

sys.exit(main())
