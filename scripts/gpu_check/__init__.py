"""GPU smoke suite: the product's main paths on NVIDIA GPUs, one table at the end (``bash scripts/gpu_check.sh``,
``python -m scripts.gpu_check``; the command line and the checks: :mod:`scripts.gpu_check.cli`).

- :mod:`~scripts.gpu_check.cli`: arguments, the loop over the checks, the table;
- :mod:`~scripts.gpu_check.context`: the result row and the context the checks run their commands through;
- :mod:`~scripts.gpu_check.checks`: the checks themselves;
- :mod:`~scripts.gpu_check.steps`, :mod:`~scripts.gpu_check.bench`, :mod:`~scripts.gpu_check.first_update`: what
  the checks run as their own processes (a BERT corpus, the HF comparison, the benchmarks, FusedAdam's first step).
"""
