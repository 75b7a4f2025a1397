"""Small corpora written the way ``python -m data_pipeline build`` writes them: random GPT token documents, and
a BERT sentence corpus of Botchan (with a tokenizer trained on it and the RACE articles) plus a tiny BERT
config; shared by the GPT dataset, fidelity, BERT/RACE, reshard and fake-CUDA tests."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_ds_suite.core.indexed_dataset_builder import MMapIndexedDatasetBuilder
from tests.helpers.distributed import SHARED_DATA

DATA = Path(SHARED_DATA)
RACE = DATA / "eval" / "RACE"
BOTCHAN = DATA / "corpus" / "botchan.txt"
SEQ = 64  # the BERT/RACE tests' sequence length


EOD = 999


def make_gpt_corpus(prefix: Path, n_docs: int, seed: int = 0, max_len: int = 60, empty_every: int = 0) -> list[np.ndarray]:
    """Documents of random tokens < EOD with EOD appended (one item per document), written to prefix."""
    rng = np.random.default_rng(seed)
    docs = []
    with MMapIndexedDatasetBuilder(prefix, np.uint16) as b:
        for k in range(n_docs):
            if empty_every and k % empty_every == 0:
                doc = np.zeros(0, dtype=np.int64)  # a zero-token item: must be skipped by the walk
            else:
                doc = np.append(rng.integers(0, EOD, rng.integers(0, max_len)), EOD)
            b.add_item(doc)
            b.end_document()
            docs.append(doc)
    return docs


def need(p: Path) -> Path:
    """``p``, or skip the test when the shared data file is absent."""
    if not p.exists():
        pytest.skip(f"shared data {p} is absent")
    return p


def write_bert_corpus(root: Path, docs: list[list[str]], flavor: str = "bert", bert: bool = True):
    """A corpus directory (manifest + tokenizer + sentence-level dataset) like `python -m data_pipeline build`."""
    from data_pipeline.tokenizer_train import train_sentencepiece
    from megatron_ds_suite.core.corpus import write_manifest
    from megatron_ds_suite.core.indexed_dataset_builder import MMapIndexedDatasetBuilder, best_dtype

    texts = [" ".join(d) for d in docs]
    race_text = [json.loads(line)["article"] for f in sorted(need(RACE).glob("*/*/*.txt"))
                 for line in f.read_text().splitlines() if line.strip()]
    tok = train_sentencepiece(texts + race_text, root / "tokenizer" / "spm", 1500, flavor=flavor, lowercase=True)
    with MMapIndexedDatasetBuilder(root / "sent", best_dtype(tok.vocab_size)) as b:
        for d in docs:
            b.add_document([np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(d) if ids])
    write_manifest(root, tok.spec(), None if bert else "sent", "sent" if bert else None, {})
    return tok


def botchan_docs(lines_per_doc: int = 30) -> list[list[str]]:
    """Botchan cut into documents of ``lines_per_doc`` lines, each split into sentences."""
    from data_pipeline.sentences import split_sentences

    lines = need(BOTCHAN).read_text(encoding="utf-8").lstrip("\ufeff").splitlines()
    return [split_sentences(" ".join(x.strip() for x in lines[i:i + lines_per_doc]))
            for i in range(0, len(lines), lines_per_doc)]


def bert_cfg(corpus: Path, run_dir: Path, extra: dict | None = None):
    """A 2-layer, hidden-32 BERT at TP 2 on ``corpus`` for 3 iterations; ``extra`` updates sections."""
    from training.config import config_from_dict

    d = {"model": {"arch": "bert", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": SEQ,
                   "hidden_dropout": 0.0, "attention_dropout": 0.0},
         "parallel": {"tensor": 2},
         "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "warmup_iters": 1},
         "train": {"micro_batch_size": 4, "global_batch_size": 4, "iters": 3, "eval_iters": 1, "progress_bar": False},
         "data": {"corpus": str(corpus), "split": "90,10,0"},
         "run": {"dir": str(run_dir), "device_peak_tflops": 1.0}}
    for k, v in (extra or {}).items():
        d.setdefault(k, {}).update(v)
    return config_from_dict(d)
