import sys

from megatron_ds_suite.main_job.job import main

sys.exit(main())
