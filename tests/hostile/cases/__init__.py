"""The hostile cases by family; importing this package registers all of them in
:data:`tests.hostile.case.CASES`, in this order (the order of the reports)."""
from tests.hostile.cases import (
    checkpoints,  # noqa: F401
    corpus_inputs,  # noqa: F401
    corpus_store,  # noqa: F401
    evaluation,  # noqa: F401
    hf_interop,  # noqa: F401
    megatron_and_tools,  # noqa: F401
    run_guards,  # noqa: F401
    training_inputs,  # noqa: F401
)
