"""The corpus store does not lose or misread shards silently (issue 38, class 3).

One tiny build (the first 300 records of the default corpus, 3 ingest shards) is made once per module; each
test damages a copy of it (a copied folder must work as the original: references between stages are
relative) and checks what the next command does: a one-line error naming the file and ``build --force``, or,
where going on is right, the same bytes as the undamaged build.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.config import ConfigError, config_from_dict, load_config
from data_pipeline.doc_store import DocStore
from data_pipeline.stages import StageError, build, run_stage, work_dir
from data_pipeline.store import ShardWriter, StoreError, index_path, meta_path, shard_name, text_path
from megatron_ds_suite.core.errors import SuiteError

ROOT = Path(__file__).resolve().parents[2]
OUTPUTS = ("documents.jsonl", "gpt_text_document.bin", "gpt_text_document.idx", "rejects.jsonl", "duplicates.jsonl")


def _cfg(out: Path, *over: str):
    return load_config(ROOT / "configs" / "data" / "tiny.yaml", [f"output_dir={out}", "workers=1", *over])


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("built") / "corpus"
    build(_cfg(out))
    return out


@pytest.fixture
def corpus(built: Path, tmp_path: Path) -> Path:
    """A private copy of the built corpus (``shutil.copytree``, as a user copies a folder)."""
    return Path(shutil.copytree(built, tmp_path / "copy"))


def _outputs(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in OUTPUTS}


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "build --force" in msg, msg
    return msg


def _flip(path: Path, at: int | None = None) -> None:
    """Change one byte of ``path`` in place (same length): a letter to its neighbour, else +1."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] = data[at] + 1 if data[at] != 0x7A else 0x79
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------ shard counts and markers
@pytest.mark.parametrize("stage, shard, then", [("ingest", 1, "filter"), ("ingest", 2, "build"),
                                                ("filter", 0, "dedup"), ("filter", 2, "export")])
def test_a_lost_completion_marker_is_refused(corpus, stage, shard, then):
    """A shard whose ``.done.json`` is gone is not dropped from the build (issue 38: 102 documents lost, exit 0):
    the stage recorded how many shards it wrote and the next reader of the store refuses it."""
    cfg = _cfg(corpus)
    (work_dir(cfg, stage) / f"{shard_name(shard)}.done.json").unlink()
    with pytest.raises(StoreError) as e:
        build(cfg) if then == "build" else run_stage(cfg, then)
    msg = _one_line(e)
    assert f"work/{stage}: its stage wrote 3 shard(s), 2 are finished" in msg
    assert f"shard {shard} (docs-0000{shard}.done.json) is missing" in msg


def test_a_shard_the_stage_did_not_write_is_refused(corpus):
    cfg = _cfg(corpus)
    folder = work_dir(cfg, "filter")
    for f in folder.glob(f"{shard_name(2)}.*"):
        shutil.copyfile(f, folder / f.name.replace(shard_name(2), shard_name(3)))
    with pytest.raises(StoreError, match="it also holds shard 3, which its stage did not write"):
        run_stage(cfg, "dedup")


@pytest.mark.parametrize("stage, key, delta", [("ingest", "read", 5), ("dedup", "removed", -1),
                                               ("filter", "too_short", 2)])
def test_a_build_that_does_not_reconcile_fails_in_one_line(corpus, stage, key, delta):
    cfg = _cfg(corpus)
    p = work_dir(cfg, stage) / "_stage.json"
    rec = json.loads(p.read_text())
    rec["stats"][key] += delta
    p.write_text(json.dumps(rec))
    (corpus / "stats.json").unlink()  # the export stage runs again and must not publish
    with pytest.raises(StageError) as e:
        build(cfg)
    msg = _one_line(e)
    assert msg.startswith("the build's document counts do not reconcile: read ")
    assert not (corpus / "stats.json").exists()
    assert json.loads((work_dir(cfg, "export") / "_stage.json").read_text())["status"] == "started"


# ------------------------------------------------------------------------------ indexes
@pytest.mark.parametrize("damage", ["cut", "short", "empty", "not_npy"])
@pytest.mark.parametrize("stage, then", [("ingest", "filter"), ("filter", "dedup")])
def test_a_cut_or_short_index_is_one_line(corpus, damage, stage, then):
    cfg = _cfg(corpus)
    f = index_path(work_dir(cfg, stage), 1)
    if damage == "cut":
        f.write_bytes(f.read_bytes()[:-37])
    elif damage == "short":  # a valid .npy with fewer rows: documents would vanish
        np.save(f, np.load(f)[:-4])
    elif damage == "empty":
        f.write_bytes(b"")
    else:
        f.write_bytes(b"\x93NUMPY garbage" * 8)
    with pytest.raises(StoreError) as e:
        run_stage(cfg, then)
    assert str(f) in _one_line(e)


def test_every_index_row_is_checked_against_the_file_sizes(tmp_path):
    """A row past the end of the text or metadata file is refused even when the index is otherwise consistent
    (its checksum rewritten): not only the last row, every row."""
    from data_pipeline.shard_sums import file_sum
    from data_pipeline.store import seal_shard

    texts = [f"document {i} " * (i + 1) for i in range(8)]
    for col, name in ((1, "txt"), (3, "meta.jsonl")):
        folder = tmp_path / name
        folder.mkdir()
        w = ShardWriter(folder, 0)
        for i, t in enumerate(texts):
            w.add(i, f"s{i}", t)
        w.commit({"n": len(texts)})
        rows = np.load(index_path(folder, 0))
        size = (text_path if name == "txt" else meta_path)(folder, 0).stat().st_size
        rows[2, col] = size - 1  # a middle row; the last row still fits
        np.save(index_path(folder, 0), rows)
        marker = json.loads((folder / f"{shard_name(0)}.done.json").read_text())
        files = {**marker.pop("files"), ".idx.npy": file_sum(index_path(folder, 0))}
        seal_shard(folder, 0, marker, files)
        store = DocStore(folder)  # opening reads the last row only
        with pytest.raises(StoreError, match=rf"docs-00000.idx.npy row 2 points at bytes {size - 1}\.\.\d+ of .*docs-00000\.{name}, which has {size}"):
            store.text(0)


# ------------------------------------------------------------------------------ checksums
@pytest.mark.parametrize("stage, suffix, then", [("ingest", ".txt", "filter"), ("ingest", ".meta.jsonl", "export"),
                                                 ("ingest", ".txt", "export"), ("filter", ".tok.npy", "export"),
                                                 ("ingest", ".idx.npy", "filter"), ("filter", ".idx.npy", "dedup"),
                                                 ("ingest", ".key.npy", "filter"), ("filter", ".key.npy", "dedup"),
                                                 ("ingest", ".rejects.jsonl", "export")])
def test_a_flipped_byte_in_a_shard_is_found(corpus, stage, suffix, then):
    """One changed byte (same size, still valid UTF-8 / still a valid array) is found by the stage that reads the
    file, not exported: every file of a shard has its CRC-32 in the shard's completion marker."""
    cfg = _cfg(corpus)
    f = work_dir(cfg, stage) / f"{shard_name(1)}{suffix}"
    if suffix == ".rejects.jsonl" and not f.read_bytes():
        f.write_bytes(b"\n")  # the tiny corpus rejects nothing: an added byte instead
    else:
        _flip(f, len(f.read_bytes()) - 3)
    with pytest.raises(StoreError) as e:
        run_stage(cfg, then)
    msg = _one_line(e)
    assert str(f) in msg and ("a changed byte" in msg or "grown" in msg)


def test_a_flipped_byte_is_found_by_a_store_reader(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    w = ShardWriter(folder, 0)
    for i in range(5):
        w.add(i, f"s{i}", f"text number {i}")
    w.commit({})
    assert [DocStore(folder).text(i) for i in range(5)] == [f"text number {i}" for i in range(5)]
    _flip(text_path(folder, 0), 3)
    with pytest.raises(StoreError, match="docs-00000.txt is changed: its CRC-32 is"):
        DocStore(folder).text(4)  # another document than the one changed: the whole file is checked
    _flip(text_path(folder, 0), 3)  # flipped back: readable again
    _flip(meta_path(folder, 0), 2)
    with pytest.raises(StoreError, match="docs-00000.meta.jsonl is changed"):
        DocStore(folder).meta(0)


# ------------------------------------------------------------------------------ damaged work files, --force
@pytest.mark.parametrize("damage", ["stage_binary", "stage_cut", "stage_list", "marker_garbage", "index_cut",
                                    "meta_flipped"])
def test_a_damaged_work_file_is_one_line_and_build_force_repairs_it(built, corpus, damage):
    cfg = _cfg(corpus)
    ing, flt = work_dir(cfg, "ingest"), work_dir(cfg, "filter")
    target, then = {"stage_binary": (flt / "_stage.json", "build"), "stage_cut": (ing / "_stage.json", "build"),
                    "stage_list": (work_dir(cfg, "dedup") / "_stage.json", "build"),
                    "marker_garbage": (ing / f"{shard_name(0)}.done.json", "filter"),
                    "index_cut": (flt / f"{shard_name(2)}.idx.npy", "dedup"),
                    "meta_flipped": (ing / f"{shard_name(0)}.meta.jsonl", "export")}[damage]
    data = target.read_bytes()
    target.write_bytes({"stage_binary": bytes(range(256)), "stage_cut": data[: len(data) // 2], "stage_list": b"[1, 2]",
                        "marker_garbage": b"\x00\xff{", "index_cut": data[:100]}.get(damage, data))
    if damage == "meta_flipped":
        _flip(target, 5)
    with pytest.raises(StoreError) as e:
        build(cfg) if then == "build" else run_stage(cfg, then)
    assert str(target) in _one_line(e)
    build(cfg, force=True)
    assert _outputs(corpus) == _outputs(built)
    build(cfg)  # and the repaired folder is whole again: every stage reused
    assert _outputs(corpus) == _outputs(built)


# ------------------------------------------------------------------------------ a copied corpus folder
@pytest.mark.parametrize("original", ["rebuilt", "deleted", "moved"])
def test_a_copied_corpus_reads_its_own_files(built, tmp_path, original):
    """A copy of an output folder reruns its later stages from its own work files (issue 38: it read the
    original's texts through an absolute path and exported 267 wrong texts once the original was rebuilt)."""
    first = Path(shutil.copytree(built, tmp_path / "first"))
    copy = Path(shutil.copytree(first, tmp_path / "second"))
    if original == "rebuilt":  # other documents, another tokenizer
        build(_cfg(first, "shard_size=77", "tokenizer.vocab_size=900"), force=True)
    elif original == "deleted":
        shutil.rmtree(first)
    else:
        first.rename(tmp_path / "elsewhere")
    cfg = _cfg(copy)
    run_stage(cfg, "export")
    assert _outputs(copy) == _outputs(built)
    for stage in ("filter", "dedup"):  # every later stage again, from the copy's own ingest store
        run_stage(cfg, stage)
    run_stage(cfg, "export")
    assert _outputs(copy) == _outputs(built)
    assert json.loads((work_dir(cfg, "filter") / "_text_from.json").read_text()) == {"folder": "../ingest"}


def test_an_absolute_text_reference_outside_the_work_folder_is_refused(corpus, tmp_path):
    """A store written by the previous format (an absolute ``_text_from.json``) is read only when it names a folder
    of the same work folder; one naming another corpus is refused in one line."""
    flt = work_dir(_cfg(corpus), "filter")
    (flt / "_text_from.json").write_text(json.dumps({"folder": str((flt.parent / "ingest").resolve())}))
    assert len(DocStore(flt)) > 0
    other = Path(shutil.copytree(flt.parent / "ingest", tmp_path / "other" / "work" / "ingest"))
    (flt / "_text_from.json").write_text(json.dumps({"folder": str(other)}))
    with pytest.raises(StoreError) as e:
        DocStore(flt)
    assert "by an absolute path outside" in _one_line(e)


# ------------------------------------------------------------------------------ one writer per output folder
@pytest.mark.parametrize("holder", ["corpus build", "training run"])
@pytest.mark.parametrize("command", ["build", "build --force", "stage"])
def test_two_writers_into_one_output_folder_are_refused(corpus, holder, command):
    from megatron_ds_suite.core.folder_lock import FolderBusy, FolderLock

    cfg = _cfg(corpus)
    before = {f: f.stat().st_mtime_ns for f in corpus.rglob("*") if f.is_file() and f.name != ".lock"}
    lock = FolderLock(corpus, "output_dir" if holder == "corpus build" else "run.dir", holder)
    lock.acquire()  # another open file description: flock refuses it as it refuses another process
    try:
        with pytest.raises(FolderBusy) as e:
            run_stage(cfg, "ingest") if command == "stage" else build(cfg, force=command.endswith("--force"))
    finally:
        lock.release()
    msg = str(e.value)
    assert msg.startswith(f"output_dir {corpus} is in use by another {holder} (pid ") and "\n" not in msg
    assert {f: f.stat().st_mtime_ns for f in corpus.rglob("*") if f.is_file() and f.name != ".lock"} == before
    build(cfg)  # released: the next build goes on
    assert (corpus / ".lock").read_text() == ""


def test_a_stale_lock_of_a_killed_build_is_taken_over(corpus, caplog):
    (corpus / ".lock").write_text(json.dumps({"pid": 999999999, "host": "h", "started": "t", "purpose": "corpus build"}))
    build(_cfg(corpus))
    assert "stale lock of pid 999999999" in caplog.text and (corpus / ".lock").read_text() == ""


# ------------------------------------------------------------------------------ output inside a source folder
@pytest.mark.parametrize("layout", ["inside", "same", "deep", "glob_recursive", "glob_same", "glob_two_levels",
                                    "hf_local"])
def test_an_output_folder_inside_a_source_folder_is_refused(tmp_path, layout):
    src = tmp_path / "data"
    (src / "sub").mkdir(parents=True)
    (src / "a.jsonl").write_text('{"text": "x"}\n')
    (src / "sub" / "b.jsonl").write_text('{"text": "z"}\n')
    (tmp_path / "other.jsonl").write_text('{"text": "y"}\n')
    path, out = {"inside": (src, src / "out"), "same": (src, src), "deep": (src, src / "sub" / "x" / "out"),
                 "glob_recursive": (src / "**" / "*.jsonl", src / "sub" / "out"),
                 "glob_same": (src / "*.jsonl", src),  # documents.jsonl would match
                 "glob_two_levels": (src / "*" / "*.jsonl", src / "out"),  # out/documents.jsonl would match
                 "hf_local": (src, src / "out")}[layout]
    kind = "hf" if layout == "hf_local" else "jsonl"
    with pytest.raises(ConfigError) as e:
        config_from_dict({"output_dir": str(out), "sources": [{"type": "jsonl", "path": str(tmp_path / "other.jsonl")},
                                                              {"type": kind, "path": str(path)}]})
    msg = str(e.value)
    assert msg.startswith(f"output_dir {out} lies inside sources[1].path {path}") and isinstance(e.value, SuiteError)


@pytest.mark.parametrize("layout", ["sibling", "file_source_beside", "source_inside_output", "glob_one_level"])
def test_an_output_folder_beside_its_sources_is_accepted(tmp_path, layout):
    src = tmp_path / "data"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "x"}\n')
    path, out = {"sibling": (src, tmp_path / "out"), "file_source_beside": (src / "a.jsonl", src / "out"),
                 "source_inside_output": (src, tmp_path),
                 # `data/*.jsonl` reads only data/'s own files: data/out/documents.jsonl is never one of them
                 "glob_one_level": (src / "*.jsonl", src / "out")}[layout]
    cfg = config_from_dict({"output_dir": str(out), "sources": [{"type": "jsonl", "path": str(path)}]})
    assert cfg.out == out


# ------------------------------------------------------------------------------ the previous format
def test_a_work_folder_of_the_previous_format_is_rebuilt_or_refused(built, corpus, monkeypatch):
    """Markers without checksums are refused in one line by a reader; a work folder of another ``STORE_FORMAT``
    is not finished for this version: ``stage`` says so in one line and ``build`` rebuilds it, never misreads it."""
    import data_pipeline.stages.bookkeeping as bookkeeping

    cfg = _cfg(corpus)
    folder = work_dir(cfg, "ingest")
    for k in range(3):
        marker = folder / f"{shard_name(k)}.done.json"
        marker.write_text(json.dumps({x: v for x, v in json.loads(marker.read_text()).items() if x != "files"}))
    with pytest.raises(StoreError) as e:
        DocStore(folder).text(0)
    assert "has no file checksums (an older version of the builder wrote this folder)" in _one_line(e)
    monkeypatch.setattr(bookkeeping, "STORE_FORMAT", "utf8-offsets-v1")  # as if the folder were written by v1
    with pytest.raises(StageError, match="stage 'filter' has not finished for this config"):
        run_stage(cfg, "dedup")
    build(cfg)  # the folder's stages are rebuilt (their fingerprints name the format), byte for byte as before
    assert _outputs(corpus) == _outputs(built)
    assert all("files" in json.loads((folder / f"{shard_name(k)}.done.json").read_text()) for k in range(3))
