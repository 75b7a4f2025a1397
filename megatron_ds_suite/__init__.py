"""The distribution's own package: bundled default configs (:mod:`megatron_ds_suite.configs_lookup`) and
the console commands (:mod:`megatron_ds_suite.console`). The stages live in ``data_pipeline``,
``training`` and ``evaluation``. Importing it has no side effects."""
