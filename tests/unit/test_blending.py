"""data.prefixes: Megatron .bin/.idx datasets blended by weight -- the blended i-th sample is dataset_index[i]'s
dataset_sample_index[i]-th sample of that prefix's own (Megatron 2021) GPT dataset, asked for Megatron's sample count;
deterministic and resumable, clear errors. The order itself: tests/unit/test_blending_megatron.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.distributed import SHARED_DATA

DATA = Path(SHARED_DATA)
GPT2 = DATA / "tokenizers" / "gpt2"
SPEC = {"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"), "merges_file": str(GPT2 / "gpt2-merges.txt")}


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    if not (GPT2.is_dir() and (DATA / "corpus" / "botchan.txt").is_file()):
        pytest.skip("../shared/data absent")
    from megatron_ds_suite.core.tokenizer import load_tokenizer
    from training.data.loader import tokenize_text_files

    tok = load_tokenizer(SPEC)
    d = tmp_path_factory.mktemp("prefixes")
    out = []
    for name in ("botchan", "tinyshakespeare"):
        tokenize_text_files([str(DATA / "corpus" / f"{name}.txt")], tok, d / f"{name}_text_document")
        out.append(str(d / f"{name}_text_document"))
    return out


def _cfg(tmp_path, prefixes, extra=()):
    from training.config import load_config

    ov = [f"data.prefixes={json.dumps([[3, prefixes[0]], [7, prefixes[1]]])}", f"data.tokenizer={json.dumps(SPEC)}",
          "data.corpus=null", f"run.dir={tmp_path / 'run'}", "model.seq_length=32", *extra]
    return load_config(Path(__file__).resolve().parents[2] / "configs" / "gpt2_tiny.yaml", ov)


def test_blended_training_data_draws_by_weight_and_resumes(prefixes, tmp_path):
    from training.data.gpt_dataset import build_gpt_datasets
    from training.data.loader import BatchSampler, build_datasets, resolve_sources

    cfg = _cfg(tmp_path, prefixes)
    src = resolve_sources(cfg)
    train, valid, _ = build_datasets(cfg, src, (10_000, 64, 0))
    assert len(train) == 10_000 and len(valid) == 64
    share = float((train.dataset_index == 0).mean())
    assert abs(share - 0.3) <= 0.01 and abs(float((train.dataset_index == 1).mean()) - 0.7) <= 0.01
    # Megatron's blend of these weights (independent port in tests/unit/test_blending_megatron.py)
    from tests.helpers.megatron_reference import reference_blend

    want_d, want_k = reference_blend([3, 7], 10_000)
    assert train.dataset_index.tolist() == want_d and train.dataset_sample_index.tolist() == want_k
    # each blended sample is that prefix's own GPT dataset sample (Megatron 2021's per-prefix index maps: last
    # epoch shuffled apart), each prefix asked for Megatron's int(math.ceil(val * weight * 1.005)) samples
    asked = [int(math.ceil(10_000 * w * 1.005)) for w in (3 / 10, 7 / 10)]
    assert asked == [3015, 7035]
    own = [build_gpt_datasets(p, cfg.data.split, (n, 0, 0), 32, cfg.train.seed, separate_last_epoch=True)[0]
           for n, p in zip(asked, prefixes)]
    assert [ds.num_samples for ds in train.datasets] == asked
    assert any(ds.first_epochs_samples is not None for ds in own)  # the 2021 separate last epoch is in play
    old, _, _ = build_datasets(_cfg(tmp_path, prefixes, ["data.separate_last_epoch=false"]), src, (10_000, 0, 0))
    assert all(ds.first_epochs_samples is None for ds in old.datasets)  # Megatron 2020 maps when asked
    for i in list(range(0, 10_000, 97)) + [9_999]:
        d, k = want_d[i], want_k[i]
        assert np.array_equal(train[i], own[d][k])
    # deterministic: a fresh build (e.g. a restarted run) gives the same sequence; resuming at
    # consumed_samples continues it exactly
    again, _, _ = build_datasets(cfg, resolve_sources(cfg), (10_000, 64, 0))
    full = list(BatchSampler(train, 4, 1, 0, 8).micro_batches(0)) + list(BatchSampler(train, 4, 1, 0, 8).micro_batches(8))
    resumed = list(BatchSampler(again, 4, 1, 0, 8).micro_batches(8))
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(full[2:], resumed))
    assert np.array_equal(again.dataset_index, train.dataset_index)


def test_bad_prefixes_fail_with_one_clear_line(prefixes, tmp_path):
    from training.config import ConfigError
    from training.data.loader import build_datasets, resolve_sources

    with pytest.raises(ConfigError, match=r"data.prefixes\[1\]: .*nope.bin does not exist"):
        resolve_sources(_cfg(tmp_path, [prefixes[0], str(tmp_path / "nope")]))
    with pytest.raises(ConfigError, match="not several"):
        _cfg(tmp_path, prefixes, ["data.text_files=[x.txt]"])
    with pytest.raises(ConfigError, match="is for GPT; BERT needs data.corpus"):
        _cfg(tmp_path, prefixes, ["model.arch=bert"])
    bad = _cfg(tmp_path, prefixes)
    bad.data.prefixes = [[0, prefixes[0]]]
    with pytest.raises(ConfigError, match="weight must be > 0"):
        resolve_sources(bad)
    small = _cfg(tmp_path, prefixes)  # a tokenizer with fewer ids than the data uses
    spm = DATA / "corpus" / "botchan.txt"
    from data_pipeline.tokenizer_train import train_sentencepiece

    tok = train_sentencepiece([spm.read_text(encoding="utf-8")], tmp_path / "spm", 400, "gpt")
    small.data.tokenizer = {"kind": "sentencepiece", "model_file": str(tok.model_file)}
    with pytest.raises(ConfigError, match="tokenized with another tokenizer"):
        build_datasets(small, resolve_sources(small), (10, 0, 0))


MEGATRON_STUB = """
import types
def print_rank_0(*args, **kwargs):
    pass
def get_args():
    raise RuntimeError("not used by the GPT path")
mpu = types.SimpleNamespace(get_data_parallel_group=lambda: None, get_pipeline_model_parallel_group=lambda: None,
                            get_tensor_model_parallel_group=lambda: None)
"""
HELPERS_STUB = """
import numpy as np
blend = None  # Megatron's own build_blending_indices, compiled from its helpers.cpp (set by the test)
def build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets, size, verbose):
    blend(dataset_index.ctypes.data, dataset_sample_index.ctypes.data, np.ascontiguousarray(weights).ctypes.data,
          num_datasets, size)
def build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    from megatron.data.gpt_dataset import _build_sample_idx  # Megatron's own Python twin of the C++ walk
    return _build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
"""


def test_megatrons_own_blended_dataset_reads_our_prefixes_and_draws_our_sequence(prefixes, tmp_path, monkeypatch):
    """Megatron-LM 2021 (90e0a0dd08)'s own megatron/data/{gpt_dataset,blendable_dataset,dataset_utils,
    indexed_dataset}.py, verbatim from the mirror (or MEGATRON_LM_DIR at that revision), run on CPU: stubs for
    ``megatron.print_rank_0/mpu``, the torch.distributed calls of a single rank and ``np.float`` (gone from numpy); ``helpers.build_blending_indices``
    is Megatron's C++ compiled from its helpers.cpp (tests/unit/test_blending_megatron.py), ``helpers.build_sample_idx``
    Megatron's own Python ``_build_sample_idx``. Its MMapIndexedDataset reads our .bin/.idx, and its blended
    train and valid datasets equal ours sample for sample."""
    import shutil
    import sys

    import torch

    from tests.helpers.megatron_reference import compile_megatron_blend, megatron_source
    from training.data.loader import build_datasets, resolve_sources

    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    pkg = tmp_path / "mlm" / "megatron"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text(MEGATRON_STUB)
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "data" / "helpers.py").write_text(HELPERS_STUB)
    for name in ("gpt_dataset", "blendable_dataset", "dataset_utils", "indexed_dataset"):
        (pkg / "data" / f"{name}.py").write_text(megatron_source("90e0a0dd08", f"megatron/data/{name}.py"))
    blend, _ = compile_megatron_blend(megatron_source("90e0a0dd08", "megatron/data/helpers.cpp"), tmp_path)
    data = tmp_path / "data"  # Megatron writes its index maps next to the prefixes
    data.mkdir()
    mine = []
    for p in prefixes:
        for ext in (".bin", ".idx"):
            shutil.copy(p + ext, data / (Path(p).name + ext))
        mine.append(str(data / Path(p).name))
    monkeypatch.syspath_prepend(str(tmp_path / "mlm"))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "LongTensor", torch.LongTensor, raising=False)
    monkeypatch.setattr(np, "float", float, raising=False)  # the 2021 indexed_dataset's dtype table (numpy < 1.24)
    for m in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, m)
    try:
        import megatron.data.helpers as helpers
        from megatron.data.gpt_dataset import build_train_valid_test_datasets

        helpers.blend = blend
        cfg = _cfg(tmp_path, mine, ["data.split=95,5,0"])  # Megatron asserts when a prefix lacks a split
        n_train, n_valid = 16_000, 512  # enough for 2-3 epochs of each prefix: the last epoch is separated
        mtrain, mvalid, _ = build_train_valid_test_datasets(["3", mine[0], "7", mine[1]], "mmap", cfg.data.split,
                                                            [n_train, n_valid, 0], 32, cfg.train.seed, True)
    finally:
        for m in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
            del sys.modules[m]
    train, valid, _ = build_datasets(cfg, resolve_sources(cfg), (n_train, n_valid, 0))
    assert len(mtrain) >= n_train and len(mvalid) >= n_valid
    assert [ds.num_epochs for ds in train.datasets] == [3, 2]  # both with a separated short last epoch
    assert all(ds.first_epochs_samples is not None for ds in train.datasets)
    assert np.array_equal(np.asarray(mtrain.dataset_index[:n_train]), train.dataset_index)
    assert np.array_equal(np.asarray(mtrain.dataset_sample_index[:n_train]), train.dataset_sample_index)
    for i in range(n_train):
        assert np.array_equal(mtrain[i]["text"], train[i]), i
    for i in range(n_valid):
        assert np.array_equal(mvalid[i]["text"], valid[i]), i
    # Megatron's own reader sees our files as we do
    assert [int(s) for s in mtrain.datasets[0].indexed_dataset.sizes[:50]] == \
        [int(s) for s in train.datasets[0].indexed.sizes[:50]]
