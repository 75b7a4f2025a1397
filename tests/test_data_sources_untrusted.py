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
