"""Bad input is counted, never fatal; stats reconcile; config errors are one clear line."""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipeline.config import ConfigError, config_from_dict, load_config
from data_pipeline.sentences import split_sentences
from data_pipeline.stages import build

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / ".." / "shared" / "data"
GPT2 = DATA / "tokenizers" / "gpt2"


def _paragraphs(n: int) -> list[str]:
    """n disjoint windows of 250 words of real text (Botchan, after its Gutenberg header)."""
    words = (DATA / "corpus" / "botchan.txt").read_text(encoding="utf-8-sig").split()[2000:]
    return [" ".join(words[k * 250:(k + 1) * 250]) for k in range(n)]


@pytest.fixture()
def gpt2_cfg(tmp_path):
    if not (GPT2 / "gpt2-vocab.json").exists() or not (DATA / "corpus" / "botchan.txt").exists():
        pytest.skip(f"shared data not found at {DATA}")

    def make(sources, **kw):
        d = {"output_dir": str(tmp_path / "out"), "sources": sources, "workers": 2, "shard_size": 7,
             "progress": False, "clean": {"max_doc_bytes": 20000},
             "tokenizer": {"type": "gpt2", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
                           "merges_file": str(GPT2 / "gpt2-merges.txt")}}
        d.update(kw)
        return config_from_dict(d)
    return make


def test_bad_inputs_counted_and_reconciled(tmp_path, gpt2_cfg):
    good = _paragraphs(6)
    inp = tmp_path / "in"
    inp.mkdir()
    lines = [json.dumps({"text": good[0]}), "{not json", json.dumps({"body": "no text field"}),
             json.dumps({"text": 42}), json.dumps({"text": ["a", "list"]}), json.dumps({"text": None}),
             json.dumps([1, 2]), json.dumps({"text": ""}), json.dumps({"text": " \n\t "}),
             json.dumps({"text": "x" * 30000}), '{"text": "lone \\ud800 surrogate"}', "",
             json.dumps({"text": "too short to keep."}), json.dumps({"text": good[1]}),
             json.dumps({"text": good[1] + " "}),  # exact duplicate after whitespace cleaning
             ]
    raw = "\n".join(lines).encode() + b"\n" + b'{"text": "bad \xff\xfe utf8"}\n' + b"x" * 50000 + b"\n"
    (inp / "a.jsonl").write_bytes(raw)
    with gzip.open(inp / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": good[2]}) + "\n")
    (inp / "c.jsonl.gz").write_bytes(gzip.compress(((json.dumps({"text": good[3]}) + "\n") * 50).encode())[:60])  # truncated
    (inp / "d.jsonl.gz").write_bytes(b"this is not gzip at all\n")
    txt = tmp_path / "txt"
    txt.mkdir()
    (txt / "ok.txt").write_text("\ufeff" + good[4], encoding="utf-8")
    (txt / "bad.txt").write_bytes(b"caf\xe9 " * 10)
    (txt / "big.txt").write_bytes(b"word " * 10000)
    cfg = gpt2_cfg([{"type": "jsonl", "path": str(inp)}, {"type": "text", "path": str(txt)}])
    out, stats = build(cfg)
    d = stats["documents"]
    assert d["reconciles"] and d["read"] == d["malformed"] + d["too_short"] + d["duplicates"] + d["kept"]
    r = stats["malformed_by_reason"]
    assert r["bad_json"] == 2 and r["missing_field"] == 2 and r["non_string_field"] == 2
    assert r["invalid_utf8"] == 3 and r["too_large"] == 3 and r["empty"] == 2 and r["unreadable_file"] == 2
    assert d["too_short"] == 1 and d["duplicates"] == 1 and d["kept"] == 4
    assert d["read"] == 16 + 1 + 1 + 1 + 3  # a.jsonl (its blank line is no record), b, c, d, 3 text files
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == d["malformed"] + d["too_short"] and all(x["reason"] and x["src"] for x in rejects)
    assert sum(x["reason"] == "too_short" for x in rejects) == d["too_short"]  # listed too (issue 14)
    kept = [json.loads(x) for x in (out / "documents.jsonl").read_text().splitlines()]
    assert len(kept) == 4 and not kept[-1]["text"].startswith("\ufeff")
    dup = [json.loads(x) for x in (out / "duplicates.jsonl").read_text().splitlines()]
    assert dup[0]["removed"][0]["jaccard"] == 1.0
    assert sorted((out).glob("*.tmp*")) == []



def test_deeply_nested_json_is_a_counted_reject_not_a_stopped_build(tmp_path):
    """One 2 KB line nested 1,000 deep raised RecursionError in the ingest worker and stopped every build
    (issue 30 item 4): it is a ``bad_json`` reject, counted and reported, like any malformed line."""
    from data_pipeline.sources import MAX_JSON_DEPTH

    if not (GPT2 / "gpt2-vocab.json").exists() or not (DATA / "corpus" / "botchan.txt").exists():
        pytest.skip(f"shared data not found at {DATA}")
    good = _paragraphs(4)
    nest = lambda n: "[" * n + "]" * n  # noqa: E731
    lines = [json.dumps({"text": good[0]}),
             '{"text": ' + nest(1000) + "}",  # 2 KB: deeper than the interpreter's stack
             "[" * 9000,  # unterminated, deeper still
             json.dumps({"text": good[1]})[:-1] + ', "meta": ' + nest(MAX_JSON_DEPTH + 50) + "}",  # parseable, too deep
             json.dumps({"text": good[2]})[:-1] + ', "meta": ' + nest(MAX_JSON_DEPTH - 1) + "}",  # deep but allowed
             json.dumps({"text": good[3]})]
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    config = tmp_path / "build.yaml"  # JSON is YAML
    config.write_text(json.dumps({
        "output_dir": str(tmp_path / "out"), "sources": [{"type": "jsonl", "path": str(inp)}], "workers": 2,
        "progress": False, "tokenizer": {"type": "gpt2", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
                                         "merges_file": str(GPT2 / "gpt2-merges.txt")}}), encoding="utf-8")
    for attempt in ("build", "rerun"):
        r = subprocess.run([sys.executable, "-m", "data_pipeline", "build", "--config", str(config)],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (attempt, r.stderr[-3000:])
        assert re.search(r"malformed: bad_json +3\n", r.stdout) and re.search(r"kept +3\n", r.stdout), r.stdout
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["malformed_by_reason"]["bad_json"] == 3 and stats["documents"]["kept"] == 3
    assert stats["documents"]["read"] == 6 and stats["documents"]["reconciles"]
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [(x["src"].rsplit(":", 1)[1], x["reason"]) for x in rejects] == [("2", "bad_json"), ("3", "bad_json"),
                                                                          ("4", "bad_json")]
    assert all(x["detail"].startswith(f"nested deeper than {MAX_JSON_DEPTH} levels") for x in rejects)
    kept = [json.loads(x)["text"] for x in (tmp_path / "out" / "documents.jsonl").read_text().splitlines()]
    assert kept == [good[0], good[2], good[3]]

class _OpenAIEncoder:
    """Independent reference: OpenAI's GPT-2 ``encoder.py`` BPE (byte->unicode map, regex, merge ranks)."""

    def __init__(self, vocab: Path, merges: Path):
        import regex

        self.encoder = json.loads(vocab.read_text(encoding="utf-8"))
        lines = merges.read_text(encoding="utf-8").split("\n")[1:]
        self.ranks = {tuple(m.split()): i for i, m in enumerate(lines) if m.strip()}
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        self.byte_encoder = dict(zip(bs, map(chr, cs)))
        self.pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def bpe(self, token: str) -> list[str]:
        word = list(token)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            out, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            word = out
        return word

    def __call__(self, text: str) -> dict[str, list[int]]:
        ids = []
        for tok in self.pat.findall(text):
            ids += [self.encoder[p] for p in self.bpe("".join(self.byte_encoder[b] for b in tok.encode("utf-8")))]
        return {"input_ids": ids}


def test_token_threshold_gpt2(tmp_path, gpt2_cfg):
    ref = _OpenAIEncoder(GPT2 / "gpt2-vocab.json", GPT2 / "gpt2-merges.txt")
    words = " ".join(_paragraphs(3)).split()
    by_count = {}
    for k in range(60, 200):
        t = " ".join(words[:k])
        by_count.setdefault(len(ref(t)["input_ids"]), t)
    docs = [by_count[n] for n in (126, 127, 128) if n in by_count]
    assert len(docs) >= 2
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    for count_eod in (True, False):
        cfg = gpt2_cfg([{"type": "jsonl", "path": str(tmp_path / "t.jsonl")}],
                       output_dir=str(tmp_path / f"o{count_eod}"), length={"count_eod": count_eod},
                       dedup={"enabled": False})
        out, stats = build(cfg)
        expect = [t for t in docs if len(ref(t)["input_ids"]) + count_eod >= 128]
        kept = [json.loads(x)["text"] for x in (out / "documents.jsonl").read_text().splitlines()]
        assert kept == expect and stats["documents"]["too_short"] == len(docs) - len(expect)
        assert stats["length_filter"]["tokenizer"]["kind"] and stats["length_filter"]["count_eod"] is count_eod


def test_token_threshold_sentencepiece(tmp_path, gpt2_cfg):
    import sentencepiece as spm

    from data_pipeline.tokenizer_train import train_sentencepiece

    paras = _paragraphs(40)
    tok = train_sentencepiece(paras, tmp_path / "spm", 600, flavor="gpt", seed=1)
    ref = spm.SentencePieceProcessor(model_file=str(tok.model_file))
    words = " ".join(paras[:3]).split()
    by_count = {}
    for k in range(20, 200):
        t = " ".join(words[:k])
        by_count.setdefault(len(ref.encode(t)), t)
    docs = [by_count[n] for n in (126, 127, 128) if n in by_count]
    assert len(docs) >= 2
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    cfg = gpt2_cfg([{"type": "jsonl", "path": str(tmp_path / "t.jsonl")}],
                   tokenizer={"type": "sentencepiece_model", "model_file": str(tok.model_file)},
                   dedup={"enabled": False})
    out, stats = build(cfg)
    expect = [t for t in docs if len(ref.encode(t)) + 1 >= 128]
    kept = [json.loads(x)["text"] for x in (out / "documents.jsonl").read_text().splitlines()]
    assert kept == expect and stats["length_filter"]["tokenizer"]["kind"] == tok.kind


def test_parquet_hf_and_text_blocks(tmp_path, gpt2_cfg):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = _paragraphs(5)
    pq.write_table(pa.table({"content": [good[0], None, good[1]]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"content": [1, 2]}), tmp_path / "b.parquet")
    datasets.Dataset.from_dict({"text": [good[2], good[3]]}).save_to_disk(str(tmp_path / "hf"))
    (tmp_path / "blocks.txt").write_text(good[4] + "\n\n\n" + good[0][:50] + "\n\n")
    cfg = gpt2_cfg([{"type": "parquet", "path": str(tmp_path / "*.parquet"), "text_field": "content"},
                    {"type": "hf", "path": str(tmp_path / "hf")},
                    {"type": "text", "path": str(tmp_path / "blocks.txt"), "text_mode": "blocks"}])
    out, stats = build(cfg)
    d = stats["documents"]
    assert d["read"] == 3 + 2 + 2 + 2 and d["kept"] == 5 and d["too_short"] == 1
    assert stats["malformed_by_reason"]["missing_field"] == 1
    assert stats["malformed_by_reason"]["non_string_field"] == 2 and d["reconciles"]


def test_config_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'dedup.treshold'"):
        config_from_dict({"sources": [{"type": "default"}], "dedup": {"treshold": 0.8}})
    with pytest.raises(ConfigError, match="dedup.threshold must be float"):
        config_from_dict({"sources": [{"type": "default"}]}, overrides=["dedup.threshold=high"])
    with pytest.raises(ConfigError, match="input not found"):
        config_from_dict({"sources": [{"type": "jsonl", "path": str(tmp_path / "nope.jsonl")}]})
    with pytest.raises(ConfigError, match="must be one of"):
        config_from_dict({"sources": [{"type": "csv", "path": "x"}]})
    with pytest.raises(ConfigError, match="tokenizer.num_threads must be >= 1, got 0"):
        config_from_dict({"sources": [{"type": "default"}]}, overrides=["tokenizer.num_threads=0"])
    cfg = load_config(ROOT / "configs" / "data" / "tiny.yaml", ["dedup.threshold=0.8", "sources.0.limit=5"])
    assert cfg.dedup.threshold == 0.8 and cfg.sources[0].limit == 5
    r = subprocess.run([sys.executable, "-m", "data_pipeline", "build", "--config",
                        str(ROOT / "configs" / "data" / "tiny.yaml"), f"sources.0.path={tmp_path}/missing",
                        "sources.0.type=jsonl"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "input not found" in r.stderr



@pytest.mark.parametrize("overrides,message", [
    (["dataset.gpt_prefix=../x"], "dataset.gpt_prefix must be a file name inside output_dir (no '/', '\\' or '..'), "
                                  "got '../x'"),
    (["dataset.bert_prefix=/tmp/abs"], "dataset.bert_prefix must be a file name inside output_dir (no '/', '\\' or "
                                       "'..'), got '/tmp/abs'"),
    (["dataset.gpt_prefix=.."], "dataset.gpt_prefix must be a file name inside output_dir (no '/', '\\' or '..'), "
                                "got '..'"),
    (["dataset.bert=true", "tokenizer.flavor=bert", "dataset.bert_prefix=gpt_text_document"],
     "dataset.gpt_prefix and dataset.bert_prefix are both 'gpt_text_document': the two datasets would overwrite each "
     "other; give them different names"),
])
def test_dataset_prefixes_stay_inside_the_output_folder(tmp_path, overrides, message):
    """``gpt_prefix=../x`` wrote the dataset outside output_dir (issue 30 item 8): refused in one line."""
    with pytest.raises(ConfigError) as e:
        config_from_dict({"sources": [{"type": "default"}], "output_dir": str(tmp_path / "out")}, overrides=overrides)
    assert str(e.value) == message
    assert config_from_dict({"sources": [{"type": "default"}]}, overrides=["dataset.gpt_prefix=my_corpus"])

def test_sentence_splitter():
    s = split_sentences('Mr. Smith went to Washington. He said "Hello!" Then he left, e.g. at 5 p.m. today.'
                        "\n\nNew paragraph without end")
    assert s == ["Mr. Smith went to Washington.", 'He said "Hello!"',
                 "Then he left, e.g. at 5 p.m. today.", "New paragraph without end"]
    assert split_sentences("J. R. R. Tolkien wrote books. They sold well? Yes.") == [
        "J. R. R. Tolkien wrote books.", "They sold well?", "Yes."]


def test_lazy_jsonl_records_resolve_to_the_eager_ones(tmp_path):
    """The ingest stage reads jsonl lazily (the reader only cuts lines; the worker parses each): every record,
    rejected ones included (reason, detail, provenance, user id), equals the eagerly parsed one."""
    from dataclasses import asdict

    from data_pipeline.sources import iter_source

    lines = [b"\xef\xbb\xbf" + json.dumps({"id": "first", "text": "a BOM before the first record"}).encode(),
             b"{not json", json.dumps({"body": "no text field"}).encode(), json.dumps({"text": 42}).encode(),
             json.dumps([1, 2]).encode(), json.dumps({"id": 7, "text": "an id that is a number"}).encode(),
             b'{"text": "lone \\ud800 surrogate"}', b"", b"   ", b'{"text": "bad \xff\xfe utf8"}', b"x" * 5000,
             json.dumps({"text": "y" * 3000}).encode(), json.dumps({"id": None, "text": "null id"}).encode()]
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        f.write(json.dumps({"id": "gz", "text": "from a gzip file"}).encode() + b"\n")
    cfg = config_from_dict({"sources": [{"type": "jsonl", "path": str(tmp_path), "id_field": "id"}],
                            "clean": {"max_doc_bytes": 2000}})
    eager = list(iter_source(cfg, cfg.sources[0]))
    lazy = list(iter_source(cfg, cfg.sources[0], lazy=True))
    assert any(r.line is not None for r in lazy) and all(r.line is None for r in eager)
    assert [asdict(r.resolve()) for r in lazy] == [asdict(r) for r in eager]
    reasons = [r.reason for r in eager]
    assert reasons.count("bad_json") == 2 and "invalid_utf8" in reasons and reasons.count("too_large") == 2
    assert eager[0].text == "a BOM before the first record" and eager[0].uid == "first"


def test_progress_bars_only_on_a_terminal(monkeypatch):
    """``progress`` unset: bars only when stderr is a terminal (not drawn into piped logs; issue 29); set, as
    given."""
    import io
    import sys

    from data_pipeline.config import config_from_dict

    base = {"sources": [{"type": "default"}]}
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe or file: no terminal
    assert config_from_dict(dict(base)).progress is False
    assert config_from_dict({**base, "progress": True}).progress is True

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    assert config_from_dict(dict(base)).progress is True
    assert config_from_dict({**base, "progress": False}).progress is False


@pytest.mark.parametrize("case", ["empty_folder", "damaged_save_to_disk", "unreachable_hub_name"])
def test_an_hf_source_that_cannot_load_stops_the_build_in_one_line(tmp_path, case):
    """A Hugging Face source that fails to load is one error line (exit 2) before any work, not one counted
    record next to the other sources' documents with exit 0 (no network: HF_DATASETS_OFFLINE=1)."""
    if not (GPT2 / "gpt2-vocab.json").exists():
        pytest.skip(f"shared data not found at {DATA}")
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"document number {i} " + "word " * 60}) + "\n" for i in range(5)))
    bad = tmp_path / "hf"
    if case == "empty_folder":
        bad.mkdir()
    elif case == "damaged_save_to_disk":
        bad.mkdir()
        (bad / "state.json").write_text('{"_data_files": [')
        (bad / "data-00000-of-00001.arrow").write_bytes(b"\x00not arrow")
    path = str(bad) if case != "unreachable_hub_name" else "no-such-user-x9/no-such-dataset-x9"
    conf = tmp_path / "data.yaml"
    conf.write_text(f"output_dir: {tmp_path / 'out'}\nprogress: false\nsources:\n  - type: jsonl\n    path: {good}\n"
                    f"  - type: hf\n    path: {path}\ntokenizer:\n  type: gpt2\n  vocab_file: {GPT2 / 'gpt2-vocab.json'}\n"
                    f"  merges_file: {GPT2 / 'gpt2-merges.txt'}\n")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "data_pipeline", "build", "--config", str(conf)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: source hf ") and "cannot be loaded" in lines[0], r.stderr
    assert not list((tmp_path / "out").glob("work/ingest/*.jsonl")), "work started before the source was checked"


def test_a_number_past_pythons_digit_limit_is_a_counted_reject():
    """A JSON number of 100,000 digits (a 100 KB line) raised ValueError (Python's 4,300-digit int limit) in the
    ingest worker and stopped the build with a traceback: a ``bad_json`` reject like any malformed line."""
    from data_pipeline.sources import parse_jsonl_line

    rec = parse_jsonl_line("in.jsonl:7", b'{"text": "kept?", "n": ' + b"9" * 100_000 + b"}", "text", None, 10**7)
    assert rec.reason == "bad_json" and rec.detail.startswith("Exceeds the limit (4300 digits)"), rec
    assert parse_jsonl_line("in.jsonl:8", b'{"text": "fine", "n": ' + b"9" * 4000 + b"}", "text", None, 10**7).reason is None
