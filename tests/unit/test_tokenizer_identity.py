"""Tokenizers are identified by content (issue 14): the sha256 of every tokenizer file is recorded in the
spec (corpus manifest, checkpoint) and checked at every load, so a swapped file of the same size is refused."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.distributed import SHARED_DATA

GPT2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"
pytestmark = pytest.mark.skipif(not GPT2.is_dir(), reason="../shared/data/tokenizers/gpt2 absent")


@pytest.fixture()
def files(tmp_path):
    shutil.copy(GPT2 / "gpt2-vocab.json", tmp_path / "vocab.json")
    shutil.copy(GPT2 / "gpt2-merges.txt", tmp_path / "merges.txt")
    return tmp_path


def _swap_two_merges(path: Path) -> None:
    """Another BPE with the same vocabulary (size and <|endoftext|> id unchanged): two merge ranks swapped."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[1], lines[2] = lines[2], lines[1]  # line 0 is the "#version" header
    path.write_text("".join(lines), encoding="utf-8")


def test_swapped_tokenizer_of_same_size_is_refused(files):
    from megatron_ds_suite.core.tokenizer import GPT2BPETokenizer, TokenizerError, load_tokenizer
    from megatron_ds_suite.core.tokenizer_base import sha256_file

    tok = GPT2BPETokenizer(files / "vocab.json", files / "merges.txt")
    spec = tok.spec()
    assert spec["sha256"] == {"vocab_file": sha256_file(files / "vocab.json"), "merges_file": sha256_file(files / "merges.txt")}
    assert load_tokenizer(spec).encode("Hello world") == tok.encode("Hello world")
    _swap_two_merges(files / "merges.txt")
    other = GPT2BPETokenizer(files / "vocab.json", files / "merges.txt")
    assert (other.vocab_size, other.eod) == (tok.vocab_size, tok.eod)  # what the old check compared
    with pytest.raises(TokenizerError, match=r"merges.txt has sha256 .* another tokenizer .*restore the original"):
        load_tokenizer(spec)


def test_corpus_manifest_records_and_checkssha256_file(files, tmp_path):
    import numpy as np

    from megatron_ds_suite.core.corpus import CorpusError, load_corpus, write_manifest
    from megatron_ds_suite.core.indexed_dataset_builder import MMapIndexedDatasetBuilder
    from megatron_ds_suite.core.tokenizer import GPT2BPETokenizer

    root = tmp_path / "corpus"
    root.mkdir()
    builder = MMapIndexedDatasetBuilder(root / "gpt", dtype=np.uint16)
    builder.add_document([[1, 2, 3]])
    builder.finalize()
    write_manifest(root, GPT2BPETokenizer(files / "vocab.json", files / "merges.txt").spec(), "gpt", None, {})
    assert load_corpus(root).tokenizer.vocab_size == 50257
    _swap_two_merges(files / "merges.txt")
    with pytest.raises(CorpusError, match="another tokenizer"):
        load_corpus(root)
