"""The one exception type of the evaluation stage."""
from __future__ import annotations

from megatron_ds_suite.core.errors import SuiteError


class EvalError(SuiteError):
    """Bad evaluation input (file, format, checkpoint/tokenizer mismatch): the message is one line
    saying what is wrong and, where possible, how to fix it. The CLI prints it and exits with code 2."""
