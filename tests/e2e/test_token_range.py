"""Token ids of every dataset a run opens are checked against the tokenizer (issue 30 item 3): an id in the
padding range or past it is refused in one line naming the file, the id and the vocabulary size, by every
rank; the scan is one pass, cached with the index maps."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.distributed import SHARED_DATA, free_port

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(SHARED_DATA)
BOTCHAN = DATA / "corpus" / "botchan.txt"
GPT2 = DATA / "tokenizers" / "gpt2"
GPT2_SPEC = {"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
             "merges_file": str(GPT2 / "gpt2-merges.txt")}
needs_data = pytest.mark.skipif(not (BOTCHAN.is_file() and GPT2.is_dir()), reason="../shared/data absent")


def _write(prefix: Path, docs: list[np.ndarray], dtype=np.uint16) -> Path:
    from megatron_ds_suite.core.indexed_dataset_builder import MMapIndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    with MMapIndexedDatasetBuilder(prefix, dtype) as b:
        for d in docs:
            b.add_item(d)
            b.end_document()
        b.finalize()
    return prefix


@pytest.fixture(scope="module")
def botchan_ids():
    if not (BOTCHAN.is_file() and GPT2.is_dir()):
        pytest.skip("../shared/data absent")
    from megatron_ds_suite.core.tokenizer import load_tokenizer

    tok = load_tokenizer(GPT2_SPEC)
    blocks = [b for b in BOTCHAN.read_text(encoding="utf-8").split("\n\n") if b.strip()]
    return [np.asarray(ids + [tok.eod]) for ids in tok.encode_batch(blocks)]


def _cfg(tmp_path: Path, *over: str):
    from training.config import load_config

    return load_config(ROOT / "configs" / "gpt2_tiny.yaml", [f"run.dir={tmp_path / 'run'}", "model.seq_length=32",
                                                             *over])


def test_scan_matches_an_independent_pass_and_is_cached(tmp_path, monkeypatch):
    from training.data import token_range

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 40_000, size=int(n), dtype=np.int64) for n in rng.integers(1, 3000, size=200)]
    prefix = _write(tmp_path / "c" / "rand_text_document", docs, np.int32)
    monkeypatch.setattr(token_range, "CHUNK", 4096)  # many chunks: the chunked reduction must equal one pass
    flat = np.concatenate(docs)
    assert token_range.scan_token_range(prefix) == (int(flat.min()), int(flat.max()))
    cache = tmp_path / "cache"
    assert token_range.token_range(prefix, cache) == (int(flat.min()), int(flat.max()))
    files = list(cache.glob("rand_text_document_token_range_*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["max"] == int(flat.max())
    # read back, not rescanned: a cache entry edited by hand is what comes back
    files[0].write_text(json.dumps({"min": 1, "max": 7}))
    assert token_range.token_range(prefix, cache) == (1, 7)
    _write(prefix, docs + [np.asarray([45_000])], np.int32)  # rebuilt in place: a new key, scanned again
    assert token_range.token_range(prefix, cache) == (int(flat.min()), 45_000)
    assert token_range.scan_token_range(_write(tmp_path / "empty", [np.zeros(0, np.int64)])) == (0, -1)

@needs_data
@pytest.mark.parametrize("bad_id", [50257, 60000])  # the padding range (padded vocabulary 50304) and beyond it
def test_corpus_id_outside_the_vocabulary_is_refused(botchan_ids, tmp_path, bad_id):
    from megatron_ds_suite.core.corpus import copy_tokenizer_files, write_manifest
    from training.config import ConfigError
    from training.data.loader import build_datasets, resolve_sources

    root = tmp_path / "corpus"
    docs = [d.copy() for d in botchan_ids]
    docs[-1][3] = bad_id  # one id, in the last document
    _write(root / "gpt_text_document", docs)
    write_manifest(root, copy_tokenizer_files(GPT2_SPEC, root), "gpt_text_document", None, {})
    cfg = _cfg(tmp_path, f"data.corpus={root}")
    with pytest.raises(ConfigError) as e:
        build_datasets(cfg, resolve_sources(cfg), (16, 0, 0))
    line = e.value.one_line()
    assert line.startswith("config error: data.corpus: ") and "\n" not in line
    assert f"gpt_text_document.bin holds token id {bad_id} (ids 0..{bad_id})" in line
    assert "the tokenizer has 50257 ids (0..50256)" in line
    assert not list((tmp_path / "run" / "data" / "index_cache").glob("*_idx.npy"))  # refused before any map


@needs_data
def test_prefix_id_past_the_first_million_tokens_is_refused(botchan_ids, tmp_path):
    """data.prefixes looked only at the first 2**20 tokens: an id past them trained."""
    from training.config import ConfigError
    from training.data.loader import build_datasets, resolve_sources

    docs = [d.copy() for d in botchan_ids * 16]
    assert sum(len(d) for d in docs) > (1 << 20) + 1000
    docs[-1][0] = 50300  # padding range, after the first million tokens
    bad = _write(tmp_path / "p" / "bad_text_document", docs)
    good = _write(tmp_path / "p" / "good_text_document", botchan_ids)
    cfg = _cfg(tmp_path, f"data.prefixes={json.dumps([[1, str(good)], [1, str(bad)]])}",
               f"data.tokenizer={json.dumps(GPT2_SPEC)}", "data.corpus=null")
    with pytest.raises(ConfigError, match=r"data.prefixes: .*bad_text_document.bin holds token id 50300 .* "
                                          r"the tokenizer has 50257 ids .*tokenized with another tokenizer"):
        build_datasets(cfg, resolve_sources(cfg), (16, 0, 0))


@needs_data
@pytest.mark.slow
def test_padding_range_id_at_tp2_is_one_line_from_the_launcher(tmp_path):
    """At TP=2 the run stops at once with exit 2 and one line (rank 1 does not wait at a barrier for rank 0).
    DeepSpeed's launcher exits with the code of the rank it sees end first: rank 1, when it is still connecting
    to rank 0's store as rank 0 exits 2, is aborted by c10d (SIGABRT) or killed by the launcher (SIGKILL, SIGTERM),
    and the launcher then exits 256 - signal; that race is the launcher's, and a rank waiting at a barrier would
    instead hang until the timeout."""
    from data_pipeline.tokenizer_train import train_sentencepiece
    from megatron_ds_suite.core.corpus import copy_tokenizer_files, write_manifest

    lines = [x for x in BOTCHAN.read_text(encoding="utf-8").splitlines() if x.strip()]
    tok = train_sentencepiece(lines, tmp_path / "spm" / "botchan", vocab_size=1000, flavor="gpt", seed=1)
    ids = [np.asarray(x + [tok.eod]) for x in tok.encode_batch(lines[:400])]
    ids[200][1] = 1000  # the padding range: TP=2 pads 1000 ids to 1024 rows
    root = tmp_path / "corpus"
    _write(root / "gpt_text_document", ids)
    write_manifest(root, copy_tokenizer_files(tok.spec(), root), "gpt_text_document", None, {})
    run = tmp_path / "run"
    over = {"data.corpus": str(root), "run.dir": str(run), "train.progress_bar": "false", "model.seq_length": "32",
            "parallel.tensor": "2", "train.micro_batch_size": "2", "train.global_batch_size": "2",
            "train.iters": "2", "optimizer.warmup_iters": "1"}
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           "--module", "training.pretrain", "--config", "configs/gpt2_tiny.yaml", *[f"{k}={v}" for k, v in over.items()]]
    res = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, DS_ACCELERATOR="cpu"), capture_output=True, text=True,
                         timeout=300)
    signalled = {256 - sig for sig in (6, 9, 15)}  # the launcher's sys.exit(-signal) of a rank it saw killed
    assert res.returncode == 2 or res.returncode in signalled, res.stdout[-3000:] + res.stderr[-3000:]
    errors = [x for x in (res.stdout + res.stderr).splitlines() if "config error:" in x]
    assert len(errors) == 1 and "gpt_text_document.bin holds token id 1000" in errors[0], res.stderr[-3000:]
    assert "the tokenizer has 1000 ids" in errors[0]
    assert "Traceback" not in res.stderr and not (run / "checkpoints").exists()
