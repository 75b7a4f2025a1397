"""The distribution's own package, two floors in one root (as Megatron's ``megatron.core`` and its training
code are):

* :mod:`megatron_ds_suite.core` -- the ground floor under the three stages (``data_pipeline``, ``training``,
  ``evaluation``): tokenizers, the indexed dataset, the corpus manifest, the config loader, errors; with
  :mod:`megatron_ds_suite.configs_lookup` (the bundled default configs, standard library only) it imports no
  stage.
* :mod:`megatron_ds_suite.app` -- the application floor on top of the stages: the main job, the console
  commands and the test helpers.

Imports go down only (docs/architecture.md, checked by ``tests/unit/test_architecture.py``). Importing this
package has no side effects."""
