"""Fixtures shared by several test files, for all three tiers (unit, parallel, e2e); helpers shared as plain
functions live in tests/helpers/. No test module imports another test module."""
from __future__ import annotations

import signal

import pytest

from tests.helpers.training_runs import BOTCHAN, train_spm_model

# A suite started in the background of a non-interactive shell (`bash .ci/run &`, nohup) inherits SIGINT
# ignored, and so would every process it starts: the Ctrl-C tests (in-process and in subprocesses) would see
# no interrupt at all. They test our handling of SIGINT, so the suite takes SIGINT back as Python's default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Every test starts with one torch intra-op thread. The tests' tensors are tiny: a second thread only adds a
    barrier per op, and on a busy 2-core machine (the suite's ranks and child processes, other jobs) that barrier
    waits for a descheduled thread: a 2-layer toy GPT's forward took ~100 ms with 2 threads against ~1 ms with one.
    An in-process Trainer still picks its own count (training/resolve.py); the next test starts at one again."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def random_gpt2(tmp_path_factory):
    """(folder, run dir): a random transformers GPT-2 saved locally (tests/helpers/hf_models.py) and its TP=1
    import by training.tools.import_hf; shared by the import and generation tests."""
    pytest.importorskip("transformers")
    from tests.helpers.hf_models import GPT2_TOKENIZER, save_random_gpt2

    if not GPT2_TOKENIZER.is_dir():
        pytest.skip("../shared/data/tokenizers/gpt2 absent")
    from training.tools.import_hf import import_hf

    root = tmp_path_factory.mktemp("random_gpt2")
    src = save_random_gpt2(root / "hf")
    return src, import_hf(str(src), root / "imported")


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory):
    """The spec of a 1000-piece sentencepiece model trained on Botchan (tests/helpers/training_runs.py)."""
    if not BOTCHAN.is_file():
        pytest.skip("../shared/data/corpus/botchan.txt not present")
    return train_spm_model(tmp_path_factory.mktemp("spm"))
