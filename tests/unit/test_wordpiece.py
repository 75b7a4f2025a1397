"""Tokenizer kinds users bring: ``wordpiece`` (BERT vocab.txt) gives transformers' BertTokenizer ids on real
text (cased and lower-cased), ``hf`` reads a tokenizer.json; both load from a spec and serve BERT/RACE."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.distributed import SHARED_DATA

pytest.importorskip("transformers")
DATA = Path(SHARED_DATA)
BOTCHAN = DATA / "corpus" / "botchan.txt"


def _texts() -> list[str]:
    lam = DATA / "eval" / "lambada" / "lambada_test.jsonl"
    shakes = DATA / "corpus" / "tinyshakespeare.txt"
    if not (BOTCHAN.is_file() and lam.is_file() and shakes.is_file()):
        pytest.skip("../shared/data corpora absent")
    texts = [json.loads(line)["text"] for line in lam.read_text(encoding="utf-8").splitlines()[:300]]
    texts += shakes.read_text(encoding="utf-8").split("\n\n")[:200]
    texts += ["Ünïcödé café naïve 日本語テキスト and ＦＵＬＬ width, emoji 😀, tabs\tand\u00a0nbsp, [SEP] [MASK] literal",
              "a" * 150 + " overlong word", "e-mail: x@y.com; 3.14159 + 2,000 = ?! (brackets) «quotes»"]
    return texts


@pytest.fixture(scope="module")
def vocab_txt(tmp_path_factory):
    """A 3,000-piece BERT vocab.txt trained with tokenizers' WordPiece trainer on botchan."""
    from tokenizers import BertWordPieceTokenizer

    if not BOTCHAN.is_file():
        pytest.skip("botchan.txt absent")
    d = tmp_path_factory.mktemp("wordpiece")
    trainer = BertWordPieceTokenizer(lowercase=False)
    trainer.train([str(BOTCHAN)], vocab_size=3000, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                  show_progress=False)
    trainer.save_model(str(d))
    return d / "vocab.txt"


@pytest.mark.parametrize("lowercase", [True, False])
def test_wordpiece_ids_equal_transformers_bert_tokenizers(vocab_txt, lowercase):
    from transformers import BertTokenizerFast

    from megatron_ds_suite.core.tokenizer import load_tokenizer

    ours = load_tokenizer({"kind": "wordpiece", "vocab_file": str(vocab_txt), "lowercase": lowercase})
    assert (ours.pad, ours.unk, ours.cls, ours.sep, ours.mask, ours.eod) == (0, 1, 2, 3, 4, 3)
    assert ours.vocab_size == len(vocab_txt.read_text(encoding="utf-8").splitlines())
    texts = _texts()
    fast = BertTokenizerFast.from_pretrained(str(vocab_txt.parent), do_lower_case=lowercase)  # from vocab.txt
    want_fast = fast(texts, add_special_tokens=False)["input_ids"]
    got = ours.encode_batch(texts)
    special = "[SEP] [MASK]"  # transformers matches these spellings as special ids; ours keeps text as text
    for t, a, b in zip(texts, got, want_fast):
        if special not in t:
            assert a == b, t[:80]
        assert a == ours.encode(t)
    assert sum(map(len, got)) > 30_000 and sum(i == ours.unk for ids in got for i in ids) < 0.05 * sum(map(len, got))
    assert ours.spec()["lowercase"] is lowercase and load_tokenizer(ours.spec()).encode(texts[0]) == got[0]
    # whole-word masking needs word starts: '##' pieces continue a word
    mask = ours.word_start_mask()
    assert all(mask[i] == (not ours.id_to_piece(i).startswith("##")) for i in range(0, ours.vocab_size, 37))


def test_hf_tokenizer_json_kind(vocab_txt, tmp_path):
    from transformers import BertTokenizerFast

    from megatron_ds_suite.core.tokenizer import TokenizerError, load_tokenizer

    BertTokenizerFast.from_pretrained(str(vocab_txt.parent), do_lower_case=True).save_pretrained(str(tmp_path / "tok"))
    ours = load_tokenizer({"kind": "hf", "tokenizer_file": str(tmp_path / "tok" / "tokenizer.json")})
    ref = load_tokenizer({"kind": "wordpiece", "vocab_file": str(vocab_txt)})
    texts = [t for t in _texts() if "[SEP]" not in t]
    assert ours.encode_batch(texts) == ref.encode_batch(texts)  # no [CLS]/[SEP] post-processing added
    assert ours.eod == ref.sep and ours.cls == ref.cls and ours.vocab_size == ref.vocab_size
    # both kinds export back to a tokenizer AutoTokenizer loads with the same ids (training.tools.hf_tokenizer)
    from transformers import AutoTokenizer

    from training.tools.hf_tokenizer import save_hf_tokenizer

    for kind, tok in (("hf", ours), ("wordpiece", ref)):
        save_hf_tokenizer(tok, tmp_path / f"export_{kind}", 512)
        back = AutoTokenizer.from_pretrained(str(tmp_path / f"export_{kind}"))
        assert back(texts[:50], add_special_tokens=False)["input_ids"] == tok.encode_batch(texts[:50])
    with pytest.raises(TokenizerError, match="none of"):
        load_tokenizer({"kind": "hf", "tokenizer_file": str(tmp_path / "tok" / "tokenizer.json"), "eod_token": "<nope>"})


def test_race_and_bert_samples_encode_with_wordpiece(vocab_txt):
    """RACE questions encode as [CLS] qa [SEP] article [SEP] with WordPiece ids (the RACE scorer's input)."""
    race = DATA / "eval" / "RACE"
    if not race.is_dir():
        pytest.skip("RACE sample absent")
    from megatron_ds_suite.core.race import encode_questions, read_race_split
    from megatron_ds_suite.core.tokenizer import load_tokenizer

    tok = load_tokenizer({"kind": "wordpiece", "vocab_file": str(vocab_txt)})
    qs, _ = read_race_split(race, "dev")
    samples = encode_questions(qs, tok, 128)
    s = samples[0]
    row = list(s["text"][0])
    assert row[0] == tok.cls and row.count(tok.sep) == 2 and tok.unk not in row[:10]
