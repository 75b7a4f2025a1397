"""``python -m training.plan``: the planner's command line (:mod:`training.plan.cli`)."""
from __future__ import annotations

import sys

from training.plan.cli import main

sys.exit(main())
