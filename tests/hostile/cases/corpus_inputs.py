"""The corpus builder (``python -m data_pipeline``) on wrong configs, overrides, tokenizers and sources: binary,
nested, cut, mis-encoded or missing inputs, prefixes escaping the output folder, loading scripts.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.hostile.case import case
from tests.hostile.commands import built_corpus, data_build, jsonl
from tests.hostile.damage import binary_file, malformed_counted, rejects_counted, truncate
from tests.hostile.fixtures import BINARY, fixture


@case("data_pipeline", "build_ok", "a correct tiny build (control)", "ok")
def _(p, tmp):
    return data_build(p, tmp)


@case("data_pipeline", "config_typo_key", "unknown key `shard_sise` in the corpus config")
def _(p, tmp):
    return data_build(p, tmp, shard_sise=10)


@case("data_pipeline", "config_wrong_type", "`workers: two`")
def _(p, tmp):
    return data_build(p, tmp, workers="two")


@case("data_pipeline", "config_duplicate_key", "a key written twice in the YAML")
def _(p, tmp):
    cmd = data_build(p, tmp)
    conf = Path(cmd[-1])
    conf.write_text(conf.read_text() + "workers: 2\n")
    return cmd


@case("data_pipeline", "config_missing", "--config names no file")
def _(p, tmp):
    return ["python", "-m", "data_pipeline", "build", "--config", str(tmp / "nope.yaml")]


@case("data_pipeline", "config_binary", "--config is a binary file")
def _(p, tmp):
    binary_file(tmp / "c.yaml")
    return ["python", "-m", "data_pipeline", "build", "--config", str(tmp / "c.yaml")]


@case("data_pipeline", "config_is_list", "the YAML is a list, not a mapping")
def _(p, tmp):
    (tmp / "c.yaml").write_text("- a\n- b\n")
    return ["python", "-m", "data_pipeline", "build", "--config", str(tmp / "c.yaml")]


@case("data_pipeline", "config_yaml_syntax", "a YAML syntax error")
def _(p, tmp):
    (tmp / "c.yaml").write_text("output_dir: [unclosed\nworkers: 1\n")
    return ["python", "-m", "data_pipeline", "build", "--config", str(tmp / "c.yaml")]


@case("data_pipeline", "override_no_equals", "an override without `=`")
def _(p, tmp):
    return data_build(p, tmp, None, "dedup.threshold")


@case("data_pipeline", "override_unknown_section", "override `nosuch.key=1`")
def _(p, tmp):
    return data_build(p, tmp, None, "nosuch.key=1")


@case("data_pipeline", "dedup_threshold_range", "`dedup.threshold=1.5`")
def _(p, tmp):
    return data_build(p, tmp, None, "dedup.threshold=1.5")


@case("data_pipeline", "shard_size_zero", "`shard_size=0`")
def _(p, tmp):
    return data_build(p, tmp, None, "shard_size=0")


@case("data_pipeline", "vocab_too_small", "SentencePiece `tokenizer.vocab_size=5`")
def _(p, tmp):
    return data_build(p, tmp, None, "tokenizer.type=sentencepiece", "tokenizer.vocab_size=5",
                      "tokenizer.vocab_file=null", "tokenizer.merges_file=null")


@case("data_pipeline", "vocab_too_large", "SentencePiece vocabulary larger than the corpus allows")
def _(p, tmp):
    return data_build(p, tmp, None, "tokenizer.type=sentencepiece", "tokenizer.vocab_size=60000",
                      "tokenizer.vocab_file=null", "tokenizer.merges_file=null")


@case("data_pipeline", "tokenizer_files_missing", "tokenizer.vocab_file names no file")
def _(p, tmp):
    return data_build(p, tmp, None, f"tokenizer.vocab_file={tmp / 'none.json'}")


@case("data_pipeline", "tokenizer_vocab_binary", "tokenizer.vocab_file is a binary file")
def _(p, tmp):
    binary_file(tmp / "v.json")
    return data_build(p, tmp, None, f"tokenizer.vocab_file={tmp / 'v.json'}")


@case("data_pipeline", "source_missing", "a source path that does not exist")
def _(p, tmp):
    return data_build(p, tmp, [{"type": "jsonl", "path": str(tmp / "nowhere.jsonl")}])


@case("data_pipeline", "source_empty_file", "a jsonl source with no record")
def _(p, tmp):
    (tmp / "e.jsonl").write_text("")
    return data_build(p, tmp, [{"type": "jsonl", "path": str(tmp / "e.jsonl")}])


@case("data_pipeline", "source_unknown_type", "`type: csv`")
def _(p, tmp):
    return data_build(p, tmp, [{"type": "csv", "path": str(fixture(p, "text"))}])


@case("data_pipeline", "binary_as_text_source", "a binary file given as a text source", "either",
      check=malformed_counted("invalid_utf8"))
def _(p, tmp):
    (tmp / "blob.txt").write_bytes(BINARY * 4)
    return data_build(p, tmp, [{"type": "text", "path": str(tmp / "blob.txt")},
                               {"type": "text", "path": str(fixture(p, "text")), "text_mode": "blocks"}])


@case("data_pipeline", "binary_as_jsonl_source", "a binary line in a .jsonl", "either",
      check=malformed_counted("invalid_utf8"))
def _(p, tmp):
    return data_build(p, tmp, jsonl(tmp, [BINARY[128:400]]))


@case("data_pipeline", "gzip_named_jsonl", "gzip bytes in a .jsonl without .gz", "either",
      check=malformed_counted("invalid_utf8"))
def _(p, tmp):
    import gzip

    src = jsonl(tmp, [])
    f = Path(src[0]["path"])
    (tmp / "z.jsonl").write_bytes(gzip.compress(f.read_bytes()))
    return data_build(p, tmp, [{"type": "jsonl", "path": str(tmp / "z.jsonl")}] + src)


@case("data_pipeline", "deeply_nested_json", "one 2 KB line nested 1,000 deep among good lines", "ok",
      check=rejects_counted("bad_json"))
def _(p, tmp):
    return data_build(p, tmp, jsonl(tmp, ["[" * 1000 + "]" * 1000]))


@case("data_pipeline", "deeply_nested_text_field", "a record whose text is a 1,000-deep object", "ok",
      check=malformed_counted("bad_json"))
def _(p, tmp):
    return data_build(p, tmp, jsonl(tmp, ['{"text": ' + "{\"a\": " * 1000 + "1" + "}" * 1000 + "}"]))


@case("data_pipeline", "malformed_json_line", "a cut JSON line", "ok", check=rejects_counted("bad_json"))
def _(p, tmp):
    return data_build(p, tmp, jsonl(tmp, ['{"text": "cut sho']))


@case("data_pipeline", "text_not_string", "`text` is a number / null / list", "ok",
      check=malformed_counted("non_string_field"))
def _(p, tmp):
    return data_build(p, tmp, jsonl(tmp, ['{"text": 12}', '{"text": null}', '{"text": ["a"]}', '"just a string"']))


@case("data_pipeline", "huge_number_json", "a JSON number with 100,000 digits in one line", "ok",
      check=malformed_counted("bad_json"))
def _(p, tmp):
    return data_build(p, tmp, jsonl(tmp, ['{"text": "x", "n": ' + "9" * 100000 + "}"]))


@case("data_pipeline", "latin1_text_source", "a Latin-1 (not UTF-8) text file", "either",
      check=malformed_counted("invalid_utf8"))
def _(p, tmp):
    (tmp / "l.txt").write_bytes(("caf\xe9 na\xefve " * 400).encode("latin-1"))
    return data_build(p, tmp, [{"type": "text", "path": str(tmp / "l.txt")},
                               {"type": "text", "path": str(fixture(p, "text")), "text_mode": "blocks"}])


@case("data_pipeline", "workers_negative", "`workers=-1` (all cores, as joblib reads it, or refused)", "either")
def _(p, tmp):
    return data_build(p, tmp, None, "workers=-1")


@case("data_pipeline", "source_is_directory_of_binaries", "a jsonl source folder holding only .bin files")
def _(p, tmp):
    (tmp / "d").mkdir()
    binary_file(tmp / "d" / "a.bin")
    return data_build(p, tmp, [{"type": "jsonl", "path": str(tmp / "d")}])


def _warned_once(p, tmp, res):
    n = sum("not read" in line for line in res.out.splitlines())
    return None if n == 1 else f"the 'file(s) not read' warning appears {n} times"


@case("data_pipeline", "dir_source_stray_file", "a jsonl folder holding a README, read as 5 one-record shards",
      "ok", check=_warned_once)
def _(p, tmp):
    d = tmp / "in"
    d.mkdir()
    shutil.copyfile(jsonl(tmp, [])[0]["path"], d / "a.jsonl")
    (d / "README.md").write_text("what this folder holds\n")
    return data_build(p, tmp, [{"type": "jsonl", "path": str(d)}], "shard_size=1")


@case("data_pipeline", "prefix_escapes_output", "`dataset.gpt_prefix=../x`",
      check=lambda p, tmp, res: "wrote outside the output folder" if list(tmp.glob("x.*")) else None)
def _(p, tmp):
    return data_build(p, tmp, None, "dataset.gpt_prefix=../x")


@case("data_pipeline", "prefix_absolute", "`dataset.gpt_prefix=/abs/path`",
      check=lambda p, tmp, res: "wrote outside the output folder" if list((tmp / "abs").glob("y.*")) else None)
def _(p, tmp):
    (tmp / "abs").mkdir()
    return data_build(p, tmp, None, f"dataset.gpt_prefix={tmp / 'abs' / 'y'}")


@case("data_pipeline", "prefixes_equal", "gpt_prefix == bert_prefix with both datasets on")
def _(p, tmp):
    return data_build(p, tmp, None, "dataset.bert=true", "dataset.gpt_prefix=same", "dataset.bert_prefix=same")


@case("data_pipeline", "output_dir_is_file", "output_dir is an existing file")
def _(p, tmp):
    cmd = data_build(p, tmp)
    (tmp / "out").write_text("not a folder")
    return cmd


@case("data_pipeline", "hf_source_not_dataset", "`type: hf` on a folder that is not a dataset")
def _(p, tmp):
    (tmp / "notds").mkdir()
    (tmp / "notds" / "readme.md").write_text("hello")
    return data_build(p, tmp, [{"type": "hf", "path": str(tmp / "notds")},
                               {"type": "text", "path": str(fixture(p, "text")), "text_mode": "blocks"}])


@case("data_pipeline", "hf_source_loading_script", "`type: hf` naming a loading script (would run code)",
      check=lambda p, tmp, res: "the loading script ran" if (tmp / "PWNED").exists() else None)
def _(p, tmp):
    (tmp / "ds").mkdir()
    (tmp / "ds" / "ds.py").write_text(f"open({str(tmp / 'PWNED')!r}, 'w').write('x')\n")
    return data_build(p, tmp, [{"type": "hf", "path": str(tmp / "ds")}])


@case("data_pipeline", "parquet_no_text_column", "a parquet file without the text column")
def _(p, tmp):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a b c"] * 5}), tmp / "t.parquet")
    return data_build(p, tmp, [{"type": "parquet", "path": str(tmp / "t.parquet")}])


def _first_shard(out: Path) -> Path:
    """The ingest store's first text shard: ``docs-00000.txt`` (UTF-8 texts + offsets, since the binary store) or
    ``docs-00000.jsonl`` (older checkouts probed with --root)."""
    txt = out / "work" / "ingest" / "docs-00000.txt"
    return txt if txt.is_file() else out / "work" / "ingest" / "docs-00000.jsonl"


@case("data_pipeline", "truncated_shard", "a finished stage's shard cut short, then `stage dedup`")
def _(p, tmp):
    out, conf = built_corpus(p, tmp)
    shard = _first_shard(out)  # the filter and dedup stages read its texts
    truncate(shard, 100)
    for d in (out / "work").glob("signatures-*"):
        shutil.rmtree(d)
    return ["python", "-m", "data_pipeline", "stage", "dedup", "--config", str(conf)]


@case("data_pipeline", "missing_shard", "a finished stage's shard deleted, then `stage dedup`")
def _(p, tmp):
    out, conf = built_corpus(p, tmp)
    _first_shard(out).unlink()
    for d in (out / "work").glob("signatures-*"):
        shutil.rmtree(d)
    return ["python", "-m", "data_pipeline", "stage", "dedup", "--config", str(conf)]


@case("data_pipeline", "stage_unknown", "`stage nosuch`")
def _(p, tmp):
    out, conf = built_corpus(p, tmp)
    return ["python", "-m", "data_pipeline", "stage", "nosuch", "--config", str(conf)]


@case("data_pipeline", "status_fresh", "`status` of a config never built (control)", "ok")
def _(p, tmp):
    return data_build(p, tmp, cmd="status")


@case("data_pipeline", "rebuild_is_noop", "`build` again on a finished corpus (control)", "ok")
def _(p, tmp):
    out, conf = built_corpus(p, tmp)
    return ["python", "-m", "data_pipeline", "build", "--config", str(conf)]


@case("data_pipeline", "overlap_binary_eval", "a binary evaluation file given to `overlap`")
def _(p, tmp):
    binary_file(tmp / "set.tokens")
    src = jsonl(tmp, [])
    return ["python", "-m", "data_pipeline", "overlap", "--corpus", src[0]["path"], "--against",
            f"x={tmp / 'set.tokens'}", "--workers", "1"]


@case("data_pipeline", "overlap_binary_corpus", "a binary line in the corpus given to `overlap`")
def _(p, tmp):
    (tmp / "set.tokens").write_text("a b c d e f g h i j\n")
    src = jsonl(tmp, [BINARY[128:300]])
    return ["python", "-m", "data_pipeline", "overlap", "--corpus", src[0]["path"], "--against",
            f"x={tmp / 'set.tokens'}", "--workers", "1"]


@case("data_pipeline", "overlap_missing_corpus", "`overlap --corpus` names nothing")
def _(p, tmp):
    (tmp / "set.tokens").write_text("a b c d e f g h i j\n")
    return ["python", "-m", "data_pipeline", "overlap", "--corpus", str(tmp / "none"), "--against",
            f"x={tmp / 'set.tokens'}", "--workers", "1"]


@case("data_pipeline", "overlap_eval_set_nested_line", "an overlap eval set (jsonl) with a line nested 1,000 deep")
def _(p, tmp):
    (tmp / "set.jsonl").write_text(json.dumps({"text": "a b c d e f g h i j"}) + "\n" + "[" * 1000 + "]" * 1000 + "\n")
    src = jsonl(tmp, [])
    return ["python", "-m", "data_pipeline", "overlap", "--corpus", src[0]["path"], "--against",
            f"x={tmp / 'set.jsonl'}", "--workers", "1"]


@case("data_pipeline", "overlap_corpus_huge_number", "an overlap corpus line holding a 100,000-digit number")
def _(p, tmp):
    (tmp / "set.tokens").write_text("a b c d e f g h i j\n")
    src = jsonl(tmp, ['{"text": "x", "n": ' + "9" * 100000 + "}"])
    return ["python", "-m", "data_pipeline", "overlap", "--corpus", src[0]["path"], "--against",
            f"x={tmp / 'set.tokens'}", "--workers", "1"]


@case("data_pipeline", "overlap_against_no_equals", "`overlap --against FILE` without NAME=")
def _(p, tmp):
    src = jsonl(tmp, [])
    return ["python", "-m", "data_pipeline", "overlap", "--corpus", src[0]["path"], "--against", src[0]["path"]]
