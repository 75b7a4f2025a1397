"""training.checkpoint_catalog: which checkpoints are whole, where a resume starts, what is moved (never deleted).

Tag folders are made here as files of known bytes, complete ones through the catalog's own ``begin_save`` /
``finish_save`` (what ``training.checkpoint.save`` calls around DeepSpeed's writes), so every case checks the bytes
on disk before and after: nothing a refusal or a resume meets may be lost. The real save and resume (DeepSpeed's
files, exit codes, the one line) are in tests/e2e/test_checkpoint_catalog_runs.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from training import checkpoint_catalog as catalog
from training.checkpoint_reader import model_files
from training.safe_load import CheckpointError, CheckpointMissing

FILES = {"mp_rank_00_model_states.pt": 3000, "mp_rank_01_model_states.pt": 2500, "zero_pp_rank_0_optim.pt": 700}


def _complete(run: Path, iteration: int, latest: bool = True) -> Path:
    """A checkpoint written the way training.checkpoint.save writes one (marker, files, record, latest)."""
    tag = catalog.tag_name(iteration)
    folder = catalog.begin_save(run, tag)
    for name, size in FILES.items():
        (folder / name).write_bytes(bytes([iteration % 251]) * size)
    catalog.sync_folder(folder)
    latest_before = catalog.read_latest_or_none(run)
    catalog.finish_save(run, tag, iteration)
    if not latest:  # finish_save always points latest at the new tag; some cases need the old pointer back
        path = catalog.checkpoint_dir(run) / catalog.LATEST
        path.unlink()
        if latest_before is not None:
            path.write_text(latest_before)
    return folder


def _saving(run: Path, iteration: int) -> Path:
    """A save killed after some files were written: marker, a cut file, no record."""
    folder = catalog.begin_save(run, catalog.tag_name(iteration))
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04 cut")
    return folder


def _unmarked(run: Path, iteration: int) -> Path:
    """A checkpoint of the format before completion records: files only."""
    folder = catalog.checkpoint_dir(run) / catalog.tag_name(iteration)
    folder.mkdir(parents=True)
    for name, size in FILES.items():
        (folder / name).write_bytes(b"u" * size)
    return folder


def _tree(run: Path) -> dict[str, bytes]:
    """Every file under the run with its bytes (what must survive a refusal)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _data_files(run: Path) -> dict[str, bytes]:
    """The checkpoint files proper (records, markers and pointers left out), keyed by tag and name wherever the
    folder now is: a move keeps them, a loss drops them."""
    return {f"{p.parent.name}/{p.name}": p.read_bytes() for p in sorted(run.rglob("*.pt"))}


def test_a_save_records_every_file_and_its_size_then_points_latest(tmp_path):
    folder = _complete(tmp_path, 4)
    record = json.loads((folder / catalog.RECORD).read_text())
    assert record == {"tag": "iter_0000004", "iteration": 4, "files": FILES}
    assert not (folder / catalog.SAVING).exists()
    assert catalog.read_latest(tmp_path) == "iter_0000004"
    assert [(t.name, t.state) for t in catalog.scan(tmp_path)] == [("iter_0000004", "complete")]
    assert catalog.plan_resume(tmp_path) == catalog.ResumePlan("iter_0000004")


@pytest.mark.parametrize("others", ["complete", "unmarked", "complete+saving"])
def test_a_missing_latest_is_refused_naming_the_newest_complete_tag_and_nothing_is_removed(tmp_path, others):
    if others == "unmarked":
        _unmarked(tmp_path, 2)
        _unmarked(tmp_path, 4)
    else:
        _complete(tmp_path, 2)
        _complete(tmp_path, 4)
        if others == "complete+saving":
            _saving(tmp_path, 6)
    (catalog.checkpoint_dir(tmp_path) / catalog.LATEST).unlink(missing_ok=True)
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError) as e:
        catalog.plan_resume(tmp_path)
    line = str(e.value)
    assert "\n" not in line and "latest is missing" in line and "nothing was deleted" in line
    if others == "unmarked":
        assert "(iter_0000002, iter_0000004) predate completion records" in line
    else:
        assert "the newest is iter_0000004" in line and "train.resume_tag=iter_0000004" in line
    assert _tree(tmp_path) == before
    # evaluation / export read the same folder: one line naming the tag to pass
    with pytest.raises(CheckpointMissing, match="pass --tag iter_0000004" if others != "unmarked" else
                       "has no checkpoints/latest"):
        model_files(tmp_path, None)


def test_the_resume_tag_resumes_a_run_whose_latest_is_lost(tmp_path):
    _complete(tmp_path, 2)
    _complete(tmp_path, 4)
    (catalog.checkpoint_dir(tmp_path) / catalog.LATEST).unlink()
    before = _data_files(tmp_path)
    plan = catalog.plan_resume(tmp_path, "iter_0000004")
    assert plan == catalog.ResumePlan("iter_0000004", explicit=True)
    catalog.carry_out(tmp_path, plan)
    assert catalog.read_latest(tmp_path) == "iter_0000004"  # a plain rerun resumes from it again
    assert _data_files(tmp_path) == before


@pytest.mark.parametrize("newer", [["complete"], ["complete", "complete"], ["complete", "saving"]])
def test_a_rolled_back_latest_is_refused_and_nothing_newer_is_touched(tmp_path, newer):
    _complete(tmp_path, 2)
    for i, state in enumerate(newer, start=2):
        (_complete if state == "complete" else _saving)(tmp_path, 2 * i)
    (catalog.checkpoint_dir(tmp_path) / catalog.LATEST).write_text("iter_0000002")  # a person or a script did this
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError) as e:
        catalog.plan_resume(tmp_path)
    newest = max(2 * i for i, s in enumerate(newer, start=2) if s == "complete")
    assert "names iter_0000002 but newer complete checkpoints exist" in str(e.value)
    assert f"write {catalog.tag_name(newest)} into" in str(e.value) and "train.resume_tag=iter_0000002" in str(e.value)
    assert _tree(tmp_path) == before


def test_going_back_on_purpose_moves_the_newer_checkpoints_aside_once(tmp_path):
    for it in (2, 4, 6):
        _complete(tmp_path, it)
    _saving(tmp_path, 8)
    before = _data_files(tmp_path)
    plan = catalog.plan_resume(tmp_path, "iter_0000002")
    assert plan == catalog.ResumePlan("iter_0000002", ["iter_0000008"], ["iter_0000004", "iter_0000006"], True)
    catalog.carry_out(tmp_path, plan)
    root = catalog.checkpoint_dir(tmp_path)
    assert sorted(p.name for p in (root / catalog.SUPERSEDED).iterdir()) == ["iter_0000004", "iter_0000006"]
    assert sorted(p.name for p in (root / catalog.INCOMPLETE).iterdir()) == ["iter_0000008"]
    assert _data_files(tmp_path) == before  # every byte still there, only moved
    assert catalog.read_latest(tmp_path) == "iter_0000002"
    # the run goes on and saves iter_4 again; the same command (still train.resume_tag=iter_2) must not go back
    # a second time and move the new checkpoint aside
    _complete(tmp_path, 4)
    assert catalog.plan_resume(tmp_path, "iter_0000002") == catalog.ResumePlan("iter_0000004")
    # killed before its first save, the rerun applies the same tag again (nothing newer to move)
    assert catalog.plan_resume(tmp_path, "iter_0000004") == catalog.ResumePlan("iter_0000004", explicit=True)


def test_a_second_move_of_the_same_tag_keeps_both(tmp_path):
    _complete(tmp_path, 2)
    first = _saving(tmp_path, 4)
    (first / "mp_rank_00_model_states.pt").write_bytes(b"first")
    catalog.carry_out(tmp_path, catalog.plan_resume(tmp_path))
    second = _saving(tmp_path, 4)
    (second / "mp_rank_00_model_states.pt").write_bytes(b"second")
    catalog.carry_out(tmp_path, catalog.plan_resume(tmp_path))
    moved = catalog.checkpoint_dir(tmp_path) / catalog.INCOMPLETE
    assert {p.name: (p / "mp_rank_00_model_states.pt").read_bytes() for p in moved.iterdir()} == {
        "iter_0000004": b"first", "iter_0000004.1": b"second"}


@pytest.mark.parametrize("newer", ["saving", "empty", "unmarked"])
def test_only_unfinished_saves_newer_than_latest_are_moved_aside(tmp_path, newer):
    _complete(tmp_path, 2)
    if newer == "saving":
        _saving(tmp_path, 4)
    elif newer == "empty":  # killed between creating the folder and writing the marker
        (catalog.checkpoint_dir(tmp_path) / "iter_0000004").mkdir()
    else:  # the old format's sign of a save killed midway
        _unmarked(tmp_path, 4)
    before = _data_files(tmp_path)
    plan = catalog.plan_resume(tmp_path)
    assert plan == catalog.ResumePlan("iter_0000002", ["iter_0000004"])
    catalog.carry_out(tmp_path, plan)
    assert not (catalog.checkpoint_dir(tmp_path) / "iter_0000004").exists()
    assert (catalog.checkpoint_dir(tmp_path) / catalog.INCOMPLETE / "iter_0000004").is_dir()
    assert _data_files(tmp_path) == before


def test_old_format_checkpoints_still_resume(tmp_path):
    _unmarked(tmp_path, 2)
    _unmarked(tmp_path, 4)
    (catalog.checkpoint_dir(tmp_path) / catalog.LATEST).write_text("iter_0000004")
    assert catalog.plan_resume(tmp_path) == catalog.ResumePlan("iter_0000004")
    assert model_files(tmp_path, None)[0] == "iter_0000004"


@pytest.mark.parametrize("damage", ["empty", "truncated", "missing", "longer"])
def test_a_damaged_checkpoint_file_is_one_line_naming_it(tmp_path, damage):
    folder = _complete(tmp_path, 2)
    f = folder / "mp_rank_01_model_states.pt"
    if damage == "empty":
        f.write_bytes(b"")
    elif damage == "truncated":
        f.write_bytes(f.read_bytes()[:1000])
    elif damage == "missing":
        f.unlink()
    else:
        f.write_bytes(f.read_bytes() + b"x")
    expected = {"empty": "has 0 bytes but 2500 were written (empty)",
                "truncated": "has 1000 bytes but 2500 were written (truncated)",
                "missing": "is missing (the completion record lists it)",
                "longer": "has 2501 bytes but 2500 were written (longer than written)"}[damage]
    for read in (lambda: catalog.plan_resume(tmp_path), lambda: model_files(tmp_path, None),
                 lambda: model_files(tmp_path, "iter_0000002"), lambda: catalog.plan_resume(tmp_path, "iter_0000002")):
        with pytest.raises(CheckpointError) as e:
            read()
        assert str(f) in str(e.value) and expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("record", [b"", b"{not json", b'{"files": [1, 2]}', b"\xff\xfe"])
def test_a_damaged_completion_record_is_one_line(tmp_path, record):
    folder = _complete(tmp_path, 2)
    (folder / catalog.RECORD).write_bytes(record)
    with pytest.raises(CheckpointError, match="complete.json is damaged"):
        catalog.plan_resume(tmp_path)


@pytest.mark.parametrize("pointer", [b"\x80\x81\xfe", b"iter_0000004"])
def test_latest_that_is_binary_or_names_an_unfinished_save_is_refused(tmp_path, pointer):
    _complete(tmp_path, 2)
    _saving(tmp_path, 4)
    (catalog.checkpoint_dir(tmp_path) / catalog.LATEST).write_bytes(pointer)
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError) as e:
        catalog.plan_resume(tmp_path)
    expected = "is not a text file naming a checkpoint" if pointer[0] == 0x80 else "whose save never completed"
    assert expected in str(e.value) and "train.resume_tag=iter_0000002" in str(e.value)
    assert _tree(tmp_path) == before
    with pytest.raises(CheckpointError, match="was never completed"):
        catalog.plan_resume(tmp_path, "iter_0000004")


def test_pruning_keeps_the_newest_and_never_an_unfinished_save(tmp_path):
    _unmarked(tmp_path, 1)  # an old-format checkpoint older than the rest: pruned like a complete one
    _saving(tmp_path, 3)
    for it in (2, 4, 6):
        _complete(tmp_path, it)
    assert catalog.prune(tmp_path, 2) == ["iter_0000001", "iter_0000002"]
    assert [(t.name, t.state) for t in catalog.scan(tmp_path)] == [
        ("iter_0000003", "saving"), ("iter_0000004", "complete"), ("iter_0000006", "complete")]


def test_a_new_save_over_an_unfinished_folder_of_its_tag_moves_that_aside(tmp_path):
    old = _saving(tmp_path, 2)
    (old / "mp_rank_00_model_states.pt").write_bytes(b"old")
    _complete(tmp_path, 2)
    moved = catalog.checkpoint_dir(tmp_path) / catalog.INCOMPLETE / "iter_0000002" / "mp_rank_00_model_states.pt"
    assert moved.read_bytes() == b"old"
    assert catalog.plan_resume(tmp_path) == catalog.ResumePlan("iter_0000002")


def test_a_tag_without_a_record_is_still_counted_against_its_tp_x_pp(tmp_path):
    """Checkpoints written before completion records: a missing TP shard is found by counting the model files
    against the parallel sizes the checkpoint itself records."""
    import torch

    from training.checkpoint_reader import load_merged_state_dict

    folder = _unmarked(tmp_path, 2)
    for f in folder.iterdir():
        f.unlink()
    torch.save({"module": {}, "parallel": {"tp": 2, "pp": 1, "dp": 1}}, folder / "mp_rank_00_model_states.pt")
    (catalog.checkpoint_dir(tmp_path) / catalog.LATEST).write_text("iter_0000002")
    with pytest.raises(CheckpointMissing, match=r"has 1 model file\(s\) but was saved with TP=2 PP=1 \(2 files\)"):
        load_merged_state_dict(tmp_path)
