import sys

from megatron_ds_suite.main_job.cli import main

sys.exit(main())
