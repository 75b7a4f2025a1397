import sys

from megatron_ds_suite.app.main_job.cli import main

sys.exit(main())
