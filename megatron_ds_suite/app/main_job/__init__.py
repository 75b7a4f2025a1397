"""The project's main job, end to end: ``python -m megatron_ds_suite.app.main_job`` (docs/main_job.md)."""
