"""WikiText-103 perplexity, LAMBADA and RACE accuracy with the reference implementations' conventions."""
import training  # noqa: F401  (sets THP_MEM_ALLOC_ENABLE before torch is imported: see training/__init__.py)
