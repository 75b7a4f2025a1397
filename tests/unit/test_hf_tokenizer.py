"""training.tools.hf_tokenizer: the main job's tokenizer kind (SentencePiece BPE, gpt flavour) and GPT-2 BPE written
as tokenizer.json that AutoTokenizer loads with ids identical to ours on real text; other models refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.distributed import SHARED_DATA

pytest.importorskip("transformers")
DATA = Path(SHARED_DATA)


def _real_texts() -> list[str]:
    paths = [DATA / "corpus" / "tinyshakespeare.txt", DATA / "corpus" / "botchan.txt",
             DATA / "eval" / "wikitext-103" / "wiki.valid.tokens", DATA / "eval" / "lambada" / "lambada_test.jsonl"]
    if not all(p.is_file() for p in paths):
        pytest.skip("../shared/data corpora absent")
    texts = []
    for p in paths[:3]:
        texts += p.read_text(encoding="utf-8").split("\n\n")[:600]
    texts += [json.loads(line)["text"] for line in paths[3].read_text(encoding="utf-8").splitlines()[:600]]
    return [t for t in texts if t]


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
    from data_pipeline.tokenizer_train import train_sentencepiece

    bot = DATA / "corpus" / "botchan.txt"
    if not bot.is_file():
        pytest.skip("botchan.txt absent")
    d = tmp_path_factory.mktemp("spm")
    text = [bot.read_text(encoding="utf-8")]
    return {"bpe": train_sentencepiece(text, d / "gpt_bpe", 1500, "gpt"),
            "unigram": train_sentencepiece(text, d / "gpt_uni", 1500, "gpt", model_type="unigram"),
            "bert": train_sentencepiece(text, d / "bert_bpe", 1500, "bert")}


def test_sentencepiece_bpe_tokenizer_json_gives_our_ids_on_real_text(spm_models, tmp_path):
    from transformers import AutoTokenizer

    from training.tools.hf_tokenizer import save_hf_tokenizer

    ours = spm_models["bpe"]
    save_hf_tokenizer(ours, tmp_path / "tok", 1024)
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert len(theirs) == ours.vocab_size and theirs.eos_token_id == ours.eod == 1
    texts = _real_texts()
    got = theirs(texts, add_special_tokens=False)["input_ids"]
    want = ours.encode_batch(texts)
    bad = [i for i, (a, b) in enumerate(zip(want, got)) if a != b]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, first: {texts[bad[0]][:80]!r}"
    assert sum(map(len, want)) > 100_000  # a real amount of text was compared
    for t in texts[:50]:
        assert theirs.decode(ours.encode(t)) == ours.decode(ours.encode(t)) == t


def test_gpt2_bpe_tokenizer_json_gives_our_ids(tmp_path):
    from transformers import AutoTokenizer

    from megatron_ds_suite.core.tokenizer import GPT2BPETokenizer
    from training.tools.hf_tokenizer import save_hf_tokenizer

    g = DATA / "tokenizers" / "gpt2"
    ours = GPT2BPETokenizer(g / "gpt2-vocab.json", g / "gpt2-merges.txt")
    save_hf_tokenizer(ours, tmp_path / "tok", 1024)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    texts = _real_texts()[::10]
    assert theirs(texts, add_special_tokens=False)["input_ids"] == ours.encode_batch(texts)


def test_models_that_would_change_ids_are_refused(spm_models, tmp_path):
    from training.tools.hf_tokenizer import TokenizerExportError, save_hf_tokenizer

    with pytest.raises(TokenizerExportError, match="not a SentencePiece BPE model"):
        save_hf_tokenizer(spm_models["unigram"], tmp_path / "u", 64)
    with pytest.raises(TokenizerExportError, match="would not reproduce our ids"):  # NFKC + dummy prefix
        save_hf_tokenizer(spm_models["bert"], tmp_path / "b", 64)
    assert not (tmp_path / "u").exists() and not (tmp_path / "b").exists()
