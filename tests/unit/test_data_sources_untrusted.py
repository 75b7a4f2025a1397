"""Directory sources read or report every file (issue 14): mixed-case extensions, .gz/.bz2/.xz read,
.zst read or reported as one counted record; a source that yields nothing is a one-line error."""
from __future__ import annotations

import bz2
import gzip
import json
import logging
import lzma
import shutil
import subprocess

import pytest

from data_pipeline.config import BuildConfig, ConfigError, SourceConfig
from data_pipeline.sources import iter_source


def _lines(*texts: str) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def test_directory_reads_every_file_or_reports_it(tmp_path, caplog):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_bytes(_lines("a1", "a2"))
    (d / "B.JSONL").write_bytes(_lines("b1"))
    (d / "c.jsonl.bz2").write_bytes(bz2.compress(_lines("c1")))
    (d / "e.Json.GZ").write_bytes(gzip.compress(_lines("e1")))
    (d / "f.ndjson.xz").write_bytes(lzma.compress(_lines("f1")))
    (d / "notes.csv").write_text("x,y\n")
    if shutil.which("zstd"):
        (d / "plain.jsonl").write_bytes(_lines("z1"))
        subprocess.run(["zstd", "-q", "--rm", str(d / "plain.jsonl"), "-o", str(d / "z.jsonl.zst")], check=True)
    else:
        (d / "z.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")  # a zstd magic number; unreadable without zstandard
    cfg = BuildConfig(sources=[SourceConfig(type="jsonl", path=str(d))])
    with caplog.at_level(logging.WARNING):
        recs = list(iter_source(cfg, cfg.sources[0]))
    texts = sorted(r.text for r in recs if r.text is not None)
    try:
        import zstandard  # noqa: F401
        expected_z = ["z1"]
    except ImportError:
        expected_z = []
        bad = [r for r in recs if r.text is None]
        assert len(bad) == 1 and bad[0].reason == "unreadable_file" and "zstandard" in bad[0].detail
        assert bad[0].src.startswith(str(d / "z.jsonl.zst"))
    assert texts == sorted(["a1", "a2", "b1", "c1", "e1", "f1", *expected_z])
    assert "1 file(s) not read" in caplog.text and "notes.csv" in caplog.text


@pytest.mark.parametrize("content", [None, b"", b"\n\n"])
def test_a_source_yielding_nothing_is_an_error(tmp_path, content):
    d = tmp_path / "in"
    d.mkdir()
    if content is None:
        (d / "readme.csv").write_text("no jsonl here\n")
        match = "no jsonl files there"
    else:
        (d / "empty.jsonl").write_bytes(content)
        match = "yielded no records"
    good = tmp_path / "good.jsonl"
    good.write_bytes(_lines("fine"))
    cfg = BuildConfig(sources=[SourceConfig(type="jsonl", path=str(good)), SourceConfig(type="jsonl", path=str(d))])
    assert [r.text for r in iter_source(cfg, cfg.sources[0])] == ["fine"]
    with pytest.raises(ConfigError, match=match):
        list(iter_source(cfg, cfg.sources[1]))


def test_chunk_size_change_keeps_dedup_exact_and_stale_tmp_is_removed(tmp_path):
    """Signatures cached with one dedup.chunk_size must not be reused with another (issue 14 #8)."""
    import os
    import time
    from pathlib import Path

    import numpy as np
    import yaml

    from data_pipeline.config import load_config
    from data_pipeline.planted import planted_corpus, real_words
    from data_pipeline.stages import build, run_stage, work_dir
    from tests.helpers.distributed import SHARED_DATA
    corpus, gpt2 = Path(SHARED_DATA) / "corpus", Path(SHARED_DATA) / "tokenizers" / "gpt2"
    if not (corpus / "botchan.txt").exists() or not (gpt2 / "gpt2-vocab.json").exists():
        pytest.skip("shared data absent")
    docs, _ = planted_corpus(real_words([corpus / "botchan.txt"]), families=8, variants=3, max_edit_frac=0.08, seed=3)
    src = tmp_path / "docs.jsonl"
    src.write_bytes(_lines(*docs))

    def config(chunk: int, out: str):
        cfg = {"output_dir": str(tmp_path / out), "sources": [{"type": "jsonl", "path": str(src)}], "workers": 1,
               "progress": False, "length": {"min_tokens": 16}, "dedup": {"chunk_size": chunk},
               "tokenizer": {"type": "gpt2", "vocab_file": str(gpt2 / "gpt2-vocab.json"),
                             "merges_file": str(gpt2 / "gpt2-merges.txt")}}
        (tmp_path / f"{out}.yaml").write_text(yaml.safe_dump(cfg))
        return load_config(tmp_path / f"{out}.yaml")

    removed = lambda cfg: np.load(work_dir(cfg, "dedup") / "removed.npy").tolist()  # noqa: E731
    a = config(7, "run")
    build(a)
    first = removed(a)
    assert len(first) >= 8
    sig_dirs = list((a.out / "work").glob("signatures-*"))
    stale = sig_dirs[0] / "sig-000000000000.npy.tmp999.npy"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    b = config(5, "run")  # same output folder, another chunk size
    run_stage(b, "dedup")
    assert removed(b) == first
    assert len(list((a.out / "work").glob("signatures-*"))) == 2
    run_stage(a, "dedup")  # back to the first chunk size: its cache is reused, the leftover .tmp removed
    assert removed(a) == first and not stale.exists()


def test_utf8_bom_does_not_cost_the_first_record(tmp_path):
    from evaluation.lambada import read_lambada_jsonl

    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + _lines("first", "second"))
    cfg = BuildConfig(sources=[SourceConfig(type="jsonl", path=str(f))])
    assert [(r.text, r.reason) for r in iter_source(cfg, cfg.sources[0])] == [("first", None), ("second", None)]
    assert read_lambada_jsonl(f) == ["first", "second"]


def test_documented_stage_command_with_overrides_after_config(tmp_path, capsys):
    """`python -m data_pipeline stage dedup --config C dedup.threshold=0.8` (README/docs) works as written."""
    from pathlib import Path

    import yaml

    from data_pipeline.__main__ import main
    from data_pipeline.config import load_config
    from data_pipeline.stages import is_done, run_stage
    from tests.helpers.distributed import SHARED_DATA

    gpt2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"
    if not (gpt2 / "gpt2-vocab.json").exists():
        pytest.skip("shared data absent")
    src = tmp_path / "docs.jsonl"
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    src.write_bytes(_lines(*[" ".join(words[(i + k) % 12] for k in range(40)) for i in range(12)]))
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), "workers": 1, "progress": False,
                                    "sources": [{"type": "jsonl", "path": str(src)}], "length": {"min_tokens": 8},
                                    "tokenizer": {"type": "gpt2", "vocab_file": str(gpt2 / "gpt2-vocab.json"),
                                                  "merges_file": str(gpt2 / "gpt2-merges.txt")}}))
    cfg = load_config(conf, ["dedup.threshold=0.8"])
    for stage in ("ingest", "tokenizer", "filter"):
        run_stage(cfg, stage)
    assert main(["stage", "dedup", "--config", str(conf), "dedup.threshold=0.8"]) == 0
    assert is_done(cfg, "dedup") and not is_done(load_config(conf, []), "dedup")
    assert "stage dedup finished" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # anything else left over is still refused
        main(["stage", "dedup", "--config", str(conf), "--bogus"])


def test_every_record_is_traceable_to_one_output_row(tmp_path):
    """kept (documents.jsonl), duplicate (duplicates.jsonl), too short or malformed (rejects.jsonl, with a
    reason): every input index exactly once (issue 14: too-short documents were counted, not listed)."""
    from pathlib import Path

    import yaml

    from data_pipeline.config import load_config
    from data_pipeline.stages import build
    from tests.helpers.distributed import SHARED_DATA

    gpt2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"
    if not (gpt2 / "gpt2-vocab.json").exists():
        pytest.skip("shared data absent")
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
    long_docs = [" ".join(words[(i * 5 + k * 3) % 16] + str(k % (i + 2)) for k in range(40)) for i in range(6)]
    src = tmp_path / "docs.jsonl"
    src.write_bytes(_lines(long_docs[0], "too short", long_docs[1], long_docs[0]) + b"{bad json\n"
                    + _lines(*long_docs[2:], "tiny"))
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), "workers": 1, "progress": False,
                                    "sources": [{"type": "jsonl", "path": str(src)}], "length": {"min_tokens": 16},
                                    "tokenizer": {"type": "gpt2", "vocab_file": str(gpt2 / "gpt2-vocab.json"),
                                                  "merges_file": str(gpt2 / "gpt2-merges.txt")}}))
    out, stats = build(load_config(conf, []))
    rows = lambda name: [json.loads(x) for x in (out / name).read_text().splitlines()]  # noqa: E731
    rejects = rows("rejects.jsonl")
    assert [(r["i"], r["reason"]) for r in rejects] == [(1, "too_short"), (4, "bad_json"), (9, "too_short")]
    assert "tokens < length.min_tokens=16" in rejects[0]["detail"]
    d = stats["documents"]
    assert d["too_short"] == 2 and d["malformed"] == 1 and d["duplicates"] == 1 and d["reconciles"]
    kept = [r["i"] for r in rows("documents.jsonl")]
    dups = [m["i"] for r in rows("duplicates.jsonl") for m in r["removed"]]
    assert sorted(kept + dups + [r["i"] for r in rejects]) == list(range(10))


def test_files_not_read_are_reported_once_per_build(tmp_path, caplog):
    """The 'file(s) not read' warning came from listing the folder, which every stage fingerprint does: a build of
    a folder holding one README repeated it 63 times (issue 30 item 8: 'one warning repeats ~130 times'); said once."""
    from pathlib import Path

    from data_pipeline.config import config_from_dict
    from data_pipeline.stages import build
    from tests.helpers.distributed import SHARED_DATA

    gpt2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"
    if not (gpt2 / "gpt2-vocab.json").is_file():
        pytest.skip("../shared/data absent")
    d = tmp_path / "in"
    d.mkdir()
    words = "the cat sat on the mat while the dog slept by the door".split()
    (d / "a.jsonl").write_bytes(_lines(*(" ".join(words[i:] + words[:i]) for i in range(12))))
    (d / "README.md").write_text("about this folder\n")
    cfg = config_from_dict({"output_dir": str(tmp_path / "out"), "sources": [{"type": "jsonl", "path": str(d)}],
                            "workers": 1, "shard_size": 4, "progress": False, "length": {"min_tokens": 4},
                            "tokenizer": {"type": "gpt2", "vocab_file": str(gpt2 / "gpt2-vocab.json"),
                                          "merges_file": str(gpt2 / "gpt2-merges.txt")}})
    with caplog.at_level(logging.WARNING):
        build(cfg)
    warned = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert len(warned) == 1 and "1 file(s) not read" in warned[0] and "README.md" in warned[0], warned
