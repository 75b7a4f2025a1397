"""Training resumed from damaged checkpoints: swapped tokenizers, binary or lost ``latest``, escaping or
symlinked tags, truncated, emptied, grown or malicious model files, interrupted saves, zeroed index caches.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from tests.hostile.case import case
from tests.hostile.commands import resume_cmd, train_cmd
from tests.hostile.damage import (
    config_json_unchanged,
    keep_config,
    plant_evil,
    pwned,
    snap_changed,
    snap_save,
    swap_merges,
    truncate,
)
from tests.hostile.fixtures import copy_of, latest_tag_dir
from tests.hostile.probe import Probe


@case("training", "tokenizer_swapped_same_size", "the corpus's merges file edited after the build (same size)")
def _(p, tmp):
    c = copy_of(p, "corpus", tmp / "corpus")
    swap_merges(c / "tokenizer")
    return train_cmd(p, tmp, corpus=c)


@case("training", "resume_on_another_tokenizer", "resume on a corpus made with another tokenizer of the same size")
def _(p, tmp):
    import hashlib

    copy_of(p, "run", tmp / "run")
    c = copy_of(p, "corpus", tmp / "corpus")
    swap_merges(c / "tokenizer")  # and the manifest says so: a consistent corpus of another tokenizer
    manifest = json.loads((c / "corpus.json").read_text())
    manifest["tokenizer"]["sha256"]["merges_file"] = hashlib.sha256((c / "tokenizer" / "gpt2-merges.txt")
                                                                    .read_bytes()).hexdigest()
    (c / "corpus.json").write_text(json.dumps(manifest, indent=1))
    return train_cmd(p, tmp, iters=3, corpus=c)


@case("training", "resume_binary_latest", "resume with a binary checkpoints/latest", check=config_json_unchanged)
def _(p, tmp):
    cmd = resume_cmd(p, tmp, "optimizer.lr=5e-4")
    keep_config(tmp)
    (tmp / "run" / "checkpoints" / "latest").write_bytes(b"\x80\x81\xfe\x00")
    return cmd


@case("training", "resume_latest_missing_tag", "checkpoints/latest names a tag that is gone", check=config_json_unchanged)
def _(p, tmp):
    cmd = resume_cmd(p, tmp, "optimizer.lr=5e-4")
    keep_config(tmp)
    (tmp / "run" / "checkpoints" / "latest").write_text("iter_0000009")
    return cmd


@case("training", "resume_latest_escapes", "checkpoints/latest names `../../elsewhere`")
def _(p, tmp):
    cmd = resume_cmd(p, tmp)
    (tmp / "elsewhere").mkdir()
    (tmp / "run" / "checkpoints" / "latest").write_text("../../elsewhere")
    return cmd


@case("training", "resume_symlinked_tag", "the latest tag folder is a symlink to a copy elsewhere")
def _(p, tmp):
    cmd = resume_cmd(p, tmp)
    tag = latest_tag_dir(tmp / "run")
    shutil.move(str(tag), tmp / "moved")
    tag.symlink_to(tmp / "moved")
    return cmd


@case("training", "resume_truncated_model_file", "the model states file of the latest tag cut short")
def _(p, tmp):
    cmd = resume_cmd(p, tmp)
    f = next(latest_tag_dir(tmp / "run").glob("mp_rank_00_model_states.pt"))
    truncate(f, 4096)
    return cmd


def _pt_digests(run: Path) -> dict[str, str]:
    """Every checkpoint file of a run by tag/name, wherever its tag folder now is (moved aside counts as kept)."""
    import hashlib

    return {f"{f.parent.name}/{f.name}": hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted((run / "checkpoints").rglob("*.pt"))}


def _keep_ckpts(tmp: Path) -> None:
    (tmp / "ckpts.before.json").write_text(json.dumps(_pt_digests(tmp / "run")))


def ckpts_kept(p, tmp, res):
    """Issue 38: no checkpoint file the run had is gone or changed (moved to incomplete/ or superseded/ is kept)."""
    before = json.loads((tmp / "ckpts.before.json").read_text())
    after = _pt_digests(tmp / "run")
    lost = sorted(k for k, v in before.items() if after.get(k) != v)
    return f"checkpoint files lost or changed: {', '.join(lost[:4])}" if lost else None


def _second_tag(run: Path, name: str) -> None:
    """A second whole checkpoint beside the run's iter_0000002 (its files copied: as valid as the original)."""
    shutil.copytree(run / "checkpoints" / "iter_0000002", run / "checkpoints" / name)


@case("training", "resume_latest_deleted", "checkpoints/latest lost (a run folder copied without it)",
      check=ckpts_kept)
def _(p, tmp):
    cmd = resume_cmd(p, tmp)
    (tmp / "run" / "checkpoints" / "latest").unlink()
    _keep_ckpts(tmp)
    return cmd


@case("training", "resume_latest_deleted_two_tags", "checkpoints/latest lost, two complete checkpoints",
      check=ckpts_kept)
def _(p, tmp):
    cmd = resume_cmd(p, tmp)
    _second_tag(tmp / "run", "iter_0000001")
    (tmp / "run" / "checkpoints" / "latest").unlink()
    _keep_ckpts(tmp)
    return cmd


@case("training", "resume_latest_rolled_back", "checkpoints/latest pointed at an older tag by hand",
      check=ckpts_kept)
def _(p, tmp):
    cmd = resume_cmd(p, tmp)
    _second_tag(tmp / "run", "iter_0000001")
    (tmp / "run" / "checkpoints" / "latest").write_text("iter_0000001")
    _keep_ckpts(tmp)
    return cmd


def _superseded_kept(p, tmp, res):
    problem = ckpts_kept(p, tmp, res)
    if problem:
        return problem
    moved = tmp / "run" / "checkpoints" / "superseded" / "iter_0000002"
    return None if moved.is_dir() else "the newer checkpoint was not moved to checkpoints/superseded/"


@case("training", "resume_older_tag_on_purpose", "train.resume_tag names an older tag (the documented way back)",
      "ok", check=_superseded_kept)
def _(p, tmp):
    cmd = resume_cmd(p, tmp, "train.resume_tag=iter_0000001")
    _second_tag(tmp / "run", "iter_0000001")
    _keep_ckpts(tmp)
    return cmd


def _resumed_from_2(p, tmp, res):
    problem = ckpts_kept(p, tmp, res)
    if problem:
        return problem
    return None if "resumed from iter_0000002" in res.out else "did not resume from iter_0000002"


@case("training", "resume_tag_after_latest_lost", "latest lost, train.resume_tag names the newest tag", "ok",
      check=_resumed_from_2)
def _(p, tmp):
    cmd = resume_cmd(p, tmp, "train.resume_tag=iter_0000002")
    (tmp / "run" / "checkpoints" / "latest").unlink()
    _keep_ckpts(tmp)
    return cmd


@case("training", "resume_zero_byte_model_file", "the model states file of the latest tag emptied (0 bytes)")
def _(p, tmp):
    cmd = resume_cmd(p, tmp)
    (latest_tag_dir(tmp / "run") / "mp_rank_00_model_states.pt").write_bytes(b"")
    return cmd


@case("training", "resume_model_file_grown", "the model states file of the latest tag replaced by a longer one "
      "(junk appended)")
def _(p, tmp):
    cmd = resume_cmd(p, tmp)
    f = latest_tag_dir(tmp / "run") / "mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes() + b"\0" * 4096)
    return cmd


def _moved_not_deleted(p, tmp, res):
    moved = tmp / "run" / "checkpoints" / "incomplete" / "iter_0000003" / "mp_rank_00_model_states.pt"
    if not moved.is_file() or moved.read_bytes() != b"PK\x03\x04 cut":
        return "the unfinished save was deleted, not moved to checkpoints/incomplete/"
    return None


@case("training", "resume_after_killed_save", "a save killed midway (its folder newer than latest, .saving, a cut "
      "file)", "ok", check=_moved_not_deleted)
def _(p, tmp):
    cmd = resume_cmd(p, tmp, iters=4)
    torn = tmp / "run" / "checkpoints" / "iter_0000003"
    torn.mkdir()
    (torn / ".saving").write_text("")
    (torn / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04 cut")
    return cmd


@case("training", "resume_malicious_pickle", "a model file whose pickle runs code", check=pwned)
def _(p, tmp):
    cmd = resume_cmd(p, tmp)
    plant_evil(p, latest_tag_dir(tmp / "run") / "mp_rank_00_model_states.pt", tmp / "PWNED")
    return cmd


def _cache_noticed(p, tmp, res):
    return None if re.search(r"(?i)rebuil|damaged|corrupt", res.out) else "the damaged index cache was used without a word"


def _zeroed_cache_run(p: Probe, tmp: Path, whole: bool) -> list[str]:
    """The fixture run's cached index maps, one zeroed, read by a fresh run of the same data and length."""
    run = copy_of(p, "run", tmp / "run")
    shutil.rmtree(run / "checkpoints")
    (run / "metrics.jsonl").unlink()
    f = next((run / "data" / "index_cache").glob("*_sample_idx.npy"))
    raw = bytearray(f.read_bytes())
    start = 0 if whole else 128
    raw[start:] = bytes(len(raw) - start)
    f.write_bytes(bytes(raw))
    return train_cmd(p, tmp)


@case("training", "index_cache_zeroed_whole", "a cached GPT index map (.npy) zeroed whole", "ok", check=_cache_noticed)
def _(p, tmp):
    return _zeroed_cache_run(p, tmp, True)


@case("training", "index_cache_zeroed_body", "a cached GPT index map zeroed after its header", "ok",
      check=_cache_noticed)
def _(p, tmp):
    return _zeroed_cache_run(p, tmp, False)


@case("training", "resume_partial_metrics_line", "metrics.jsonl ends in a cut line (kill), then resume", "ok",
      check=lambda p, tmp, res: None if all(_json_ok(x) for x in (tmp / "run" / "metrics.jsonl").read_text()
                                            .splitlines() if x.strip()) else "metrics.jsonl still holds a cut line")
def _(p, tmp):
    cmd = resume_cmd(p, tmp)
    with (tmp / "run" / "metrics.jsonl").open("a") as f:
        f.write('{"iteration": 3, "lo')
    return cmd


def _json_ok(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


@case("training", "run_dir_locked", "a second launch into a run.dir a live run holds",
      check=lambda p, tmp, res: "the live run's files changed" if snap_changed(tmp) else None)
def _(p, tmp):
    cmd = resume_cmd(p, tmp)
    snap_save(tmp)
    p.hold(tmp, tmp / "run")
    return cmd
