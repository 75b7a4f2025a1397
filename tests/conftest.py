"""Fixtures shared by several test files."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def random_gpt2(tmp_path_factory):
    """(folder, run dir): a random transformers GPT-2 saved locally (tests/hf_models.py) and its TP=1
    import by training.tools.import_hf; shared by the import and generation tests."""
    pytest.importorskip("transformers")
    from tests.hf_models import GPT2_TOKENIZER, save_random_gpt2

    if not GPT2_TOKENIZER.is_dir():
        pytest.skip("../shared/data/tokenizers/gpt2 absent")
    from training.tools.import_hf import import_hf

    root = tmp_path_factory.mktemp("random_gpt2")
    src = save_random_gpt2(root / "hf")
    return src, import_hf(str(src), root / "imported")
