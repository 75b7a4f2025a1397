"""The application floor: what runs the stages rather than what they are built from.

:mod:`~megatron_ds_suite.app.main_job` (the end-to-end orchestrator, ``python -m megatron_ds_suite.app.main_job``)
and :mod:`~megatron_ds_suite.app.console` (the installed ``megatron-ds-*`` commands). It may import
every stage; nothing below it (the core, the stages) imports it (``tests/unit/test_architecture.py`` checks both).
"""
