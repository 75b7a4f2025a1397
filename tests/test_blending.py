"""data.prefixes: Megatron .bin/.idx datasets blended by weight -- the blended i-th sample is dataset_index[i]'s
dataset_sample_index[i]-th sample of that prefix's own (Megatron 2021) GPT dataset, asked for Megatron's sample count;
deterministic and resumable, clear errors. The order itself: tests/test_blending_megatron.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.distributed import SHARED_DATA

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
    return load_config(Path(__file__).resolve().parents[1] / "configs" / "gpt2_tiny.yaml", ov)


def test_blended_training_data_draws_by_weight_and_resumes(prefixes, tmp_path):
    from training.data.gpt_dataset import build_gpt_datasets
    from training.data.loader import BatchSampler, build_datasets, resolve_sources

    cfg = _cfg(tmp_path, prefixes)
    src = resolve_sources(cfg)
    train, valid, _ = build_datasets(cfg, src, (10_000, 64, 0))
    assert len(train) == 10_000 and len(valid) == 64
    share = float((train.dataset_index == 0).mean())
    assert abs(share - 0.3) <= 0.01 and abs(float((train.dataset_index == 1).mean()) - 0.7) <= 0.01
    # Megatron's blend of these weights (independent port in tests/test_blending_megatron.py)
    from tests.test_blending_megatron import reference_blend

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
    with pytest.raises(ConfigError, match="for GPT-2"):
        _cfg(tmp_path, prefixes, ["model.arch=bert"])
    bad = _cfg(tmp_path, prefixes)
    bad.data.prefixes = [[0, prefixes[0]]]
    with pytest.raises(ConfigError, match="weight must be > 0"):
        resolve_sources(bad)
    small = _cfg(tmp_path, prefixes)  # a tokenizer with fewer ids than the data uses
    spm = DATA / "corpus" / "botchan.txt"
    from megatron_ds_suite.core.tokenizer_train import train_sentencepiece

    tok = train_sentencepiece([spm.read_text(encoding="utf-8")], tmp_path / "spm", 400, "gpt")
    small.data.tokenizer = {"kind": "sentencepiece", "model_file": str(tok.model_file)}
    with pytest.raises(ConfigError, match="tokenized with another tokenizer"):
        build_datasets(small, resolve_sources(small), (10, 0, 0))
