"""Benchmarks, run as modules from the repository root: ``.venv/bin/python -m benchmarks.bench_train_step ...``
(docs/benchmarks.md). Importing the package sets the process defaults every entry point sets before torch
loads (training.runtime.process_env)."""
from training.runtime.process_env import configure

configure()  # THP_MEM_ALLOC_ENABLE before torch loads
