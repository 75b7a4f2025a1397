"""The project's main job, end to end: ``python -m megatron_ds_suite.main_job`` (docs/main_job.md)."""
