"""``python -m tests.hostile``: the hostile-user probe (:mod:`tests.hostile.cli`)."""
import sys

from tests.hostile.cli import main

sys.exit(main())
