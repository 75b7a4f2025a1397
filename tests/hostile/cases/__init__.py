"""The hostile cases by family; importing this package registers all of them in
:data:`tests.hostile.case.CASES`, in this order (the order of the reports)."""
from tests.hostile.cases import corpus_inputs  # noqa: F401
from tests.hostile.cases import corpus_store  # noqa: F401
from tests.hostile.cases import training_inputs  # noqa: F401
from tests.hostile.cases import checkpoints  # noqa: F401
from tests.hostile.cases import run_guards  # noqa: F401
from tests.hostile.cases import evaluation  # noqa: F401
from tests.hostile.cases import hf_interop  # noqa: F401
from tests.hostile.cases import megatron_and_tools  # noqa: F401
