"""Test-set overlap (8-grams) and 13-gram decontamination against an independent set-of-tuples reference."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from data_pipeline.__main__ import main
from data_pipeline.config import config_from_dict
from data_pipeline.overlap import overlap_report
from data_pipeline.stages import build
from tests.helpers.distributed import SHARED_DATA

DATA = Path(SHARED_DATA)
LAMBADA = DATA / "eval" / "lambada" / "lambada_test.jsonl"
WIKI = DATA / "eval" / "wikitext-2" / "wiki.test.tokens"
BOTCHAN = DATA / "corpus" / "botchan.txt"
GPT2 = DATA / "tokenizers" / "gpt2"


def ref_grams(text: str, n: int) -> set[tuple[str, ...]]:
    """Independent reference: word n-gram tuples, never across a <unk>."""
    out: set[tuple[str, ...]] = set()
    for seg in text.split("<unk>"):
        w = re.findall(r"\w+", seg.lower())
        out.update(tuple(w[i:i + n]) for i in range(len(w) - n + 1))
    return out


@pytest.fixture()
def material(tmp_path):
    if not (LAMBADA.exists() and WIKI.exists() and BOTCHAN.exists()):
        pytest.skip(f"shared data not found under {DATA}")
    lam = [json.loads(x)["text"] for x in LAMBADA.read_text(encoding="utf-8").splitlines()[:300]]
    wiki = [x for x in WIKI.read_text(encoding="utf-8").splitlines() if x.strip()][:400]
    (tmp_path / "lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lam))
    (tmp_path / "wiki.tokens").write_text("\n".join(wiki) + "\n")
    words = BOTCHAN.read_text(encoding="utf-8").split()
    paras = [" ".join(words[k * 200:(k + 1) * 200]) for k in range(60)]
    rng = random.Random(1)
    docs = list(paras)
    for k in range(20):  # documents quoting a window of an evaluation text inside ordinary text
        src = (lam if k % 2 else wiki)[rng.randrange(40)]
        w = src.replace(" @-@ ", "-").split()
        a = rng.randrange(max(1, len(w) - 20))
        docs.append(paras[k] + " " + " ".join(w[a:a + rng.choice([6, 9, 14, 30])]) + " " + paras[k + 20])
    return tmp_path, lam, wiki, docs


def test_overlap_percentages_match_reference(material):
    tmp, lam, wiki, docs = material
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    rep = overlap_report(corpus, [("wikitext", tmp / "wiki.tokens"), ("lambada", tmp / "lambada.jsonl")],
                         n=8, workers=2)
    have = set().union(*(ref_grams(d, 8) for d in docs))
    for name, texts in (("wikitext", wiki), ("lambada", lam)):
        want = set().union(*(ref_grams(t, 8) for t in texts))
        r = rep["sets"][name]
        assert r["ngrams"] == len(want)
        assert r["found"] == len(want & have) > 0
        assert r["percent"] == round(100 * len(want & have) / len(want), 4)
    assert rep["documents"] == len(docs)
    # the CLI: same numbers in the JSON report, clear one-line error on a bad argument
    out = tmp / "rep.json"
    assert main(["overlap", "--corpus", str(corpus), "--against", f"wikitext={tmp / 'wiki.tokens'}",
                 f"lambada={tmp / 'lambada.jsonl'}", "--workers", "1", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["sets"] == rep["sets"]
    assert main(["overlap", "--corpus", str(corpus), "--against", "lambada"]) == 2
    assert main(["overlap", "--corpus", str(tmp / "nope"), "--against", f"x={tmp / 'wiki.tokens'}"]) == 2


def test_decontamination_stage(material):
    tmp, lam, wiki, docs = material
    if not (GPT2 / "gpt2-vocab.json").exists():
        pytest.skip("GPT-2 vocabulary not found")
    src = tmp / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": f"u{k}", "text": d}) + "\n" for k, d in enumerate(docs)))
    cfg = config_from_dict({
        "output_dir": str(tmp / "out"), "sources": [{"type": "jsonl", "path": str(src), "id_field": "id"}],
        "workers": 2, "shard_size": 30, "progress": False,
        "tokenizer": {"type": "gpt2", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
                      "merges_file": str(GPT2 / "gpt2-merges.txt")},
        "length": {"min_tokens": 16}, "dedup": {"chunk_size": 16},
        "decontaminate": {"against": [f"wikitext={tmp / 'wiki.tokens'}", f"lambada={tmp / 'lambada.jsonl'}"]}})
    out, stats = build(cfg)
    wg = set().union(*(ref_grams(t, 13) for t in wiki))
    lg = set().union(*(ref_grams(t, 13) for t in lam))
    dup_removed = {r["i"] for c in map(json.loads, (out / "duplicates.jsonl").read_text().splitlines())
                   for r in c["removed"]}
    want = {}
    for k, d in enumerate(docs):
        g = ref_grams(d, 13)
        sets = [n for n, e in (("wikitext", wg), ("lambada", lg)) if g & e]
        if sets and k not in dup_removed:
            want[k] = sets
    assert 3 <= len(want) < 20
    got = {r["i"]: r["sets"] for r in map(json.loads, (out / "contaminated.jsonl").read_text().splitlines())}
    assert got == want
    d = stats["documents"]
    assert d["contaminated"] == len(want) and d["reconciles"]
    kept = {r["i"] for r in map(json.loads, (out / "documents.jsonl").read_text().splitlines())}
    assert not kept & set(want) and len(kept) == d["kept"]
    with pytest.raises(Exception, match="decontaminate.against"):
        config_from_dict({"sources": [{"type": "default"}], "decontaminate": {"against": ["x=/no/such/file"]}})
