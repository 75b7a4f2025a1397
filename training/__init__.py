"""Megatron-style tensor/pipeline-parallel GPT-2 and BERT training under DeepSpeed.

Importing the package changes nothing in the process; entry points call
:func:`training.runtime.process_env.configure` (huge pages for large CPU allocations) before torch loads."""
