"""The corpus store (issue 38): a built corpus's shards, manifests and work files damaged, copied or edited, and
Ctrl-C to the build's process group in each stage, then the same command resumed.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from tests.hostile.case import case
from tests.hostile.commands import built_corpus, data_build, jsonl
from tests.hostile.damage import binary_file, flip_byte, truncate
from tests.hostile.fixtures import BINARY, SHAKESPEARE, copy_of, corpus_config, fixture, write_yaml
from tests.hostile.outcome import error_lines
from tests.hostile.probe import Probe

# A 4-shard corpus (shard_size=40 of the 149 blocks), built once; each case damages a private copy (copy_of: the
# absolute paths an older checkout's work files hold are rewritten, so only the planted damage differs).
SHARDS = {"shard_size": 40}


def _shards_fixture(p: Probe) -> Path:
    with p.lock:
        if "corpus_shards" not in p.fixtures:
            fx = p.base / "fixtures"
            fx.mkdir(exist_ok=True)
            path = fx / "corpus_shards"
            conf = write_yaml(fx / "corpus_shards.yaml", corpus_config(path, _text_source(p), fixture(p, "tok"),
                                                                       **SHARDS))
            res = p.run(["python", "-m", "data_pipeline", "build", "--config", str(conf)], timeout=600)
            p.fixture_log.append(f"fixture corpus_shards: rc={res.rc} in {res.seconds:.0f}s")
            if res.rc != 0:
                raise RuntimeError(f"fixture corpus_shards failed (rc={res.rc}): {error_lines(res.out)[-1:]}")
            p.fixtures["corpus_shards"] = path
        return p.fixtures["corpus_shards"]


def _text_source(p: Probe) -> list[dict]:
    return [{"type": "text", "path": str(fixture(p, "text")), "text_mode": "blocks"}]


def _sharded(p: Probe, tmp: Path, name: str = "corpus") -> tuple[Path, Path]:
    """A private copy of the 4-shard corpus at ``tmp/name`` and its config."""
    _shards_fixture(p)
    out = copy_of(p, "corpus_shards", tmp / name)
    return out, write_yaml(tmp / f"{name}.yaml", corpus_config(out, _text_source(p), fixture(p, "tok"), **SHARDS))


def _corpus_cmd(conf: Path, *args: str) -> list[str]:
    return ["python", "-m", "data_pipeline", *args, "--config", str(conf)]


def _same_documents(p, tmp, res):
    """The command's corpus (``tmp/corpus``) exports the documents the undamaged build exported, byte for byte."""
    got, want = tmp / "corpus" / "documents.jsonl", _shards_fixture(p) / "documents.jsonl"
    if not got.is_file():
        return "no documents.jsonl"
    return None if got.read_bytes() == want.read_bytes() else "documents.jsonl differs from the undamaged build's"


@case("data_pipeline", "store_lost_marker_then_filter", "an ingest shard's `.done.json` deleted, then a build that "
      "reruns the filter (`length.min_tokens=9`)")
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    (out / "work" / "ingest" / "docs-00001.done.json").unlink()
    return _corpus_cmd(conf, "build") + ["length.min_tokens=9"]


@case("data_pipeline", "store_lost_marker_then_dedup", "a filter shard's `.done.json` deleted, then `stage dedup`")
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    (out / "work" / "filter" / "docs-00002.done.json").unlink()
    return _corpus_cmd(conf, "stage", "dedup")


@case("data_pipeline", "store_lost_marker_then_build", "an ingest shard's `.done.json` deleted, then `build` "
      "(every stage finished)")
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    (out / "work" / "ingest" / "docs-00003.done.json").unlink()
    return _corpus_cmd(conf, "build")


@case("data_pipeline", "build_counts_do_not_reconcile", "a stage record's count changed (dedup `removed` + 1), "
      "then `build` (export reruns)")
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    rec = out / "work" / "dedup" / "_stage.json"
    data = json.loads(rec.read_text())
    data["stats"]["removed"] += 1
    rec.write_text(json.dumps(data))
    (out / "stats.json").unlink()
    return _corpus_cmd(conf, "build")


@case("data_pipeline", "store_index_cut", "an ingest shard's `.idx.npy` cut short, then a build that reruns the "
      "filter")
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    f = out / "work" / "ingest" / "docs-00001.idx.npy"
    truncate(f, -60)
    return _corpus_cmd(conf, "build") + ["length.min_tokens=9"]


@case("data_pipeline", "store_index_short", "a filter shard's `.idx.npy` replaced by a valid one with 5 rows fewer, "
      "then `stage dedup`")
def _(p, tmp):
    import numpy as np

    out, conf = _sharded(p, tmp)
    f = out / "work" / "filter" / "docs-00001.idx.npy"
    np.save(f, np.load(f)[:-5])
    return _corpus_cmd(conf, "stage", "dedup")


@case("data_pipeline", "store_index_short_then_export", "a filter shard's `.idx.npy` with 5 rows fewer, then "
      "`stage export`")
def _(p, tmp):
    import numpy as np

    out, conf = _sharded(p, tmp)
    f = out / "work" / "filter" / "docs-00002.idx.npy"
    np.save(f, np.load(f)[:-5])
    return _corpus_cmd(conf, "stage", "export")


@case("data_pipeline", "store_flipped_byte_text", "one letter of an ingest shard's `.txt` changed (same size, "
      "valid UTF-8), then `stage export`")
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    f = out / "work" / "ingest" / "docs-00001.txt"
    text = f.read_bytes()
    flip_byte(f, next(i for i in range(len(text) // 2, len(text)) if 0x61 <= text[i] <= 0x7A))
    return _corpus_cmd(conf, "stage", "export")


@case("data_pipeline", "store_flipped_byte_tokens", "one byte of a filter shard's token ids (`.tok.npy`) changed, "
      "then `stage export`")
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    f = out / "work" / "filter" / "docs-00000.tok.npy"
    flip_byte(f, len(f.read_bytes()) - 7)
    return _corpus_cmd(conf, "stage", "export")


@case("data_pipeline", "store_flipped_byte_meta", "one byte of an ingest shard's `.meta.jsonl` changed, then "
      "`stage export`")
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    f = out / "work" / "ingest" / "docs-00002.meta.jsonl"
    text = f.read_bytes()
    flip_byte(f, text.rindex(b"blocks") if b"blocks" in text else len(text) - 10)
    return _corpus_cmd(conf, "stage", "export")


@case("data_pipeline", "stage_json_damaged", "binary bytes in `work/filter/_stage.json`, then `build`")
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    binary_file(out / "work" / "filter" / "_stage.json")
    return _corpus_cmd(conf, "build")


@case("data_pipeline", "stage_json_damaged_force", "`work/ingest/_stage.json` cut in half, then `build --force` "
      "(repairs it)", "ok", check=_same_documents)
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    f = out / "work" / "ingest" / "_stage.json"
    truncate(f, 40)
    return _corpus_cmd(conf, "build", "--force")


@case("data_pipeline", "shard_marker_damaged", "binary bytes in an ingest shard's `.done.json`, then a build that "
      "reruns the filter")
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    (out / "work" / "ingest" / "docs-00000.done.json").write_bytes(BINARY[:300])
    return _corpus_cmd(conf, "build") + ["length.min_tokens=9"]


@case("data_pipeline", "store_index_damaged_force", "a filter `.idx.npy` cut, then `build --force` (repairs it)",
      "ok", check=_same_documents)
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    f = out / "work" / "filter" / "docs-00001.idx.npy"
    truncate(f, 100)
    return _corpus_cmd(conf, "build", "--force")


def _copied(p: Probe, tmp: Path) -> tuple[Path, Path]:
    """An original corpus at ``tmp/original`` and a plain copy of it (``shutil.copytree``, as a user copies a
    folder) at ``tmp/corpus``, with the copy's config."""
    orig, _ = _sharded(p, tmp, "original")
    copy = Path(shutil.copytree(orig, tmp / "corpus"))
    return orig, write_yaml(tmp / "copy.yaml", corpus_config(copy, _text_source(p), fixture(p, "tok"), **SHARDS))


@case("data_pipeline", "copied_corpus_original_rebuilt", "a copied corpus folder, the original rebuilt from other "
      "documents, then `stage export` in the copy", "ok", check=_same_documents)
def _(p, tmp):
    orig, conf = _copied(p, tmp)
    other = jsonl(tmp, [json.dumps({"text": f"REPLACED document {i}: " + "other words entirely " * 12})
                        for i in range(60)])
    oconf = write_yaml(tmp / "original.yaml", corpus_config(orig, other, fixture(p, "tok"), **SHARDS))
    res = p.run(_corpus_cmd(oconf, "build", "--force"))
    if res.rc != 0:
        raise RuntimeError(f"rebuilding the original failed: {error_lines(res.out)[-1:]}")
    return _corpus_cmd(conf, "stage", "export")


@case("data_pipeline", "copied_corpus_original_deleted", "a copied corpus folder, the original deleted, then "
      "`stage dedup` and `stage export` in the copy", "ok", check=_same_documents)
def _(p, tmp):
    orig, conf = _copied(p, tmp)
    shutil.rmtree(orig)
    return ["bash", "-c", " && ".join(f"{p.python} -m data_pipeline stage {s} --config {conf}" for s in ("dedup", "export"))]


@case("data_pipeline", "two_builds_one_output", "`build` into an output folder another process holds (its lock)")
def _(p, tmp):
    (tmp / "out").mkdir()
    p.hold(tmp, tmp / "out")
    return data_build(p, tmp)


@case("data_pipeline", "two_writers_stage", "`stage ingest` into a finished corpus another process holds",
      check=lambda p, tmp, res: "the held corpus's ingest stage was restarted" if '"started"' in (
          tmp / "corpus" / "work" / "ingest" / "_stage.json").read_text() else None)
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    p.hold(tmp, out)
    return _corpus_cmd(conf, "stage", "ingest")


@case("data_pipeline", "output_inside_source_dir", "output_dir inside a jsonl source folder (read recursively)")
def _(p, tmp):
    (tmp / "data").mkdir()
    jsonl(tmp / "data", [])
    conf = write_yaml(tmp / "c.yaml", corpus_config(tmp / "data" / "out", [{"type": "jsonl", "path": str(tmp / "data")}]))
    return _corpus_cmd(conf, "build")


@case("data_pipeline", "output_inside_source_glob", "output_dir inside the folder of a `**` glob source")
def _(p, tmp):
    (tmp / "data").mkdir()
    jsonl(tmp / "data", [])
    conf = write_yaml(tmp / "c.yaml", corpus_config(tmp / "data" / "runs" / "out",
                                                    [{"type": "jsonl", "path": str(tmp / "data" / "**" / "*.jsonl")}]))
    return _corpus_cmd(conf, "build")
# Ctrl-C (issue 38): a terminal signals the whole process group, the pool workers too. The build (all of
# tinyshakespeare, 15 shards, 2 workers, a SentencePiece tokenizer trained on it: every stage runs long enough to
# be interrupted inside it) gets SIGINT on its group once a stage has begun; then the same command must resume.
def _ctrl_c_build(p, tmp):
    cfg = corpus_config(tmp / "out", [{"type": "text", "path": str(SHAKESPEARE), "text_mode": "blocks"}],
                        workers=2, shard_size=500)
    cfg["tokenizer"] = {"type": "sentencepiece", "vocab_size": 1000}
    return ["python", "-m", "data_pipeline", "build", "--config", str(write_yaml(tmp / "c.yaml", cfg))]


def _interrupted_then_resumes(p, tmp, res):
    said = [x for x in error_lines(res.out) if x.startswith("interrupted:")]
    if len(said) != 1:
        return f"{len(said)} 'interrupted:' lines (the interrupt never landed?)"
    if res.rc != 130:
        return f"exit {res.rc}, not 130"
    again = p.run(["python", "-m", "data_pipeline", "build", "--config", str(tmp / "c.yaml")], timeout=300)
    return None if again.rc == 0 else f"the rerun did not resume (exit {again.rc}): {error_lines(again.out)[-1:]}"


for _stage, _marker in (("ingest", "out/work/ingest/docs-00000.done.json"), ("tokenizer", "out/work/tokenizer/_stage.json"),
                        ("filter", "out/work/filter/_stage.json"), ("dedup", "out/work/dedup/_stage.json"),
                        ("export", "out/work/export/_stage.json")):
    case("data_pipeline", f"ctrl_c_group_{_stage}", f"Ctrl-C to the build's process group during the {_stage} stage, "
         "then the same command", check=_interrupted_then_resumes, interrupt=_marker)(_ctrl_c_build)


def _damaged_work_file(p, tmp, rel: str, stage: str, damage: Callable[[bytes], bytes]) -> list[str]:
    out, conf = built_corpus(p, tmp)
    f = out / rel
    f.write_bytes(damage(f.read_bytes()))
    return ["python", "-m", "data_pipeline", "stage", stage, "--config", str(conf)]


@case("data_pipeline", "damaged_index_header", "a finished ingest shard's index (.npy) header zeroed, then `stage filter`")
def _(p, tmp):
    return _damaged_work_file(p, tmp, "work/ingest/docs-00000.idx.npy", "filter", lambda b: b"\0" * 60 + b[60:])


@case("data_pipeline", "damaged_meta_not_utf8", "a finished ingest shard's metadata overwritten with 0xff bytes, "
      "then `stage export`")
def _(p, tmp):
    return _damaged_work_file(p, tmp, "work/ingest/docs-00000.meta.jsonl", "export", lambda b: b"\xff" * len(b))


@case("data_pipeline", "damaged_token_offsets", "a finished filter shard's token offsets (.npy) half 0xff, then "
      "`stage export`")
def _(p, tmp):
    return _damaged_work_file(p, tmp, "work/filter/docs-00000.tokoff.npy", "export",
                              lambda b: b[:len(b) // 2] + b"\xff" * (len(b) - len(b) // 2))


@case("data_pipeline", "config_nan", "`dedup.lsh_weights=[.nan, .nan]` (NaN sums pass a range check)")
def _(p, tmp):
    return data_build(p, tmp, None, "dedup.lsh_weights=[.nan, .nan]")


@case("data_pipeline", "config_negative_cpus", "`ray.num_cpus_per_task=-1`")
def _(p, tmp):
    return data_build(p, tmp, None, "ray.num_cpus_per_task=-1")


@case("data_pipeline", "config_nested_yaml", "a corpus config nested 20,000 lists deep")
def _(p, tmp):
    (tmp / "c.yaml").write_text("workers: " + "[" * 20000 + "]" * 20000 + "\n")
    return ["python", "-m", "data_pipeline", "build", "--config", str(tmp / "c.yaml")]
