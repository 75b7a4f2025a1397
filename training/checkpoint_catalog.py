"""Which checkpoints of a run are whole, and which one a resume starts from; the only code that moves a tag folder.

A run keeps its checkpoints in RUN_DIR/checkpoints/ (one folder per tag, ``iter_0000020``) beside the pointer
``latest`` (the tag a plain resume starts from). A tag folder is in one of three states:

- **complete**: it holds ``complete.json``, the completion record (the tag, its iteration and every file with its
  size), written by rank 0 only after every rank's files were written and made durable (``fsync`` of each file on
  each host, then of the folder). Nothing is ever removed from or written into a complete folder, except by the
  user's own ``train.keep_last`` pruning of older complete tags.
- **saving**: it holds the ``.saving`` marker and no record: rank 0 wrote the marker before any rank wrote a byte of
  the save, so such a folder is a save that never finished (a kill, a power loss, a full disk). It is *provably*
  incomplete: a resume moves it to ``checkpoints/incomplete/`` (never deletes it) and says so in one line.
- **unmarked**: neither file (a checkpoint written before completion records existed, or a folder made by hand).
  Named by ``latest`` it is loaded as before; newer than the tag a resume starts from it is moved to
  ``checkpoints/incomplete/`` like a ``saving`` folder (the old format's sign of an unfinished save), never deleted.

:func:`plan_resume` decides, from what is on disk and the user's ``train.resume_tag``, which tag a run resumes
from and which folders it moves; it refuses in one line (:class:`~training.safe_load.CheckpointError`) whatever
could lose work: a missing or unreadable ``latest`` while complete checkpoints exist (the newest is named), a
``latest`` rolled back behind newer complete checkpoints, a ``latest`` or ``--tag`` naming a save that never
finished, a recorded file that is missing or shorter or longer than recorded (a 0-byte or truncated shard named).
Resuming from an older tag on purpose is ``train.resume_tag=iter_...``: the newer checkpoints are moved to
``checkpoints/superseded/`` (the run will write new ones under their names), ``latest`` is set to the tag, nothing
is deleted. The tag applied is noted in ``checkpoints/resume_tag.json``: the same command run again once the run has
saved past the tag resumes from ``latest`` (it does not go back a second time and move the new checkpoints aside).

Megatron-LM records completion in ``latest_checkpointed_iteration.txt`` alone and DeepSpeed in ``latest`` alone;
a per-tag record is what lets a lost or edited pointer be noticed instead of trusted (torchtitan's DCP writes a
``.metadata`` file last for the same reason).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_ds_suite.core import atomic
from training.safe_load import CheckpointError

logger = logging.getLogger("training")

LATEST = "latest"
RECORD = "complete.json"
SAVING = ".saving"
INCOMPLETE = "incomplete"  # where saves that never finished are moved
SUPERSEDED = "superseded"  # where checkpoints newer than an explicit train.resume_tag are moved
APPLIED = "resume_tag.json"  # the train.resume_tag a launch of this run applied (so a rerun does not apply it again)
_TAG = re.compile(r"iter_(\d+)")

State = Literal["complete", "saving", "unmarked"]


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


@dataclass(frozen=True)
class Tag:
    """One ``iter_*`` folder of a run's checkpoints/ and its state."""

    name: str
    iteration: int
    state: State


def tag_state(folder: Path) -> State:
    if (folder / RECORD).is_file():
        return "complete"
    # a folder with no file at all is a save that died between creating the folder and writing its marker
    if (folder / SAVING).exists() or not any(folder.iterdir()):
        return "saving"
    return "unmarked"


def scan(run_dir: str | Path) -> list[Tag]:
    """The ``iter_<n>`` folders of RUN_DIR/checkpoints (symbolic links left out: :func:`check_tag` refuses them
    by name), oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    tags = []
    with os.scandir(root) as entries:
        for e in entries:
            m = _TAG.fullmatch(e.name)
            if m and e.is_dir(follow_symlinks=False):
                tags.append(Tag(e.name, int(m.group(1)), tag_state(Path(e.path))))
    return sorted(tags, key=lambda t: (t.iteration, t.name))


def newest_complete(tags: list[Tag]) -> Tag | None:
    return next((t for t in reversed(tags) if t.state == "complete"), None)


def check_tag(run_dir: str | Path, tag: str, what: str = "tag") -> None:
    """A tag is one plain directory name under checkpoints/ (never a path or a symbolic link leading elsewhere)
    that exists."""
    root = checkpoint_dir(run_dir)
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or "\0" in tag:
        raise CheckpointError(f"{what} {tag!r}, which is not a checkpoint name (expected e.g. iter_0000020 inside "
                              f"{root}): fix the file or delete it to start afresh")
    if (root / tag).is_symlink():
        raise CheckpointError(f"{what} {tag!r} but {root / tag} is a symbolic link (to {(root / tag).readlink()}): a "
                              f"checkpoint must be a folder inside {root}; copy it there instead of linking")
    if not (root / tag).is_dir():
        have = [t.name for t in scan(run_dir) if t.state != "saving"]
        raise CheckpointError(f"{what} {tag!r} but {root / tag} does not exist (present: {', '.join(have) or 'none'}): "
                              f"write the newest present tag into {root / LATEST} or delete it to start afresh")


def read_latest(run_dir: str | Path) -> str | None:
    """The tag ``checkpoints/latest`` names (checked by :func:`check_tag`); None when there is no such file."""
    f = checkpoint_dir(run_dir) / LATEST
    if not f.is_file():
        return None
    try:
        tag = f.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        newest = newest_complete(scan(run_dir))
        hint = (f"write {newest.name} (the newest complete checkpoint) into it or pass train.resume_tag={newest.name}"
                if newest else "write the tag to resume from into it, or delete it to start afresh")
        raise CheckpointError(f"{f} is not a text file naming a checkpoint (e.g. iter_0000020): {hint}") from None
    check_tag(run_dir, tag, f"{f} names")
    return tag


def verify(run_dir: str | Path, tag: str) -> None:
    """Every file the completion record of ``tag`` lists is there with its recorded size (a tag without a record,
    written before records existed, passes); else one line naming the file."""
    folder = checkpoint_dir(run_dir) / tag
    record = folder / RECORD
    state = tag_state(folder)
    if state == "saving":
        raise CheckpointError(f"checkpoint {folder} was never completed (its save was interrupted: it holds no "
                              f"{RECORD}): resume from another tag (train.resume_tag=iter_...)")
    if state == "unmarked":
        return
    try:
        files = json.loads(record.read_bytes())["files"]
        sizes = {str(k): int(v) for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{record} is damaged (not the completion record this project writes): the checkpoint "
                              f"cannot be checked; resume from another tag (train.resume_tag=iter_...)") from None
    for name, size in sorted(sizes.items()):
        path = folder / name
        if "/" in name or name in (".", "..") or not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing (the completion record lists it): copy the "
                                  f"whole tag folder, or resume from another tag (train.resume_tag=iter_...)")
        have = path.stat().st_size
        if have != size:
            raise CheckpointError(f"checkpoint file {path} has {have} bytes but {size} were written "
                                  f"({'empty' if have == 0 else 'truncated' if have < size else 'longer than written'}):"
                                  f" the file was damaged or replaced; copy it again or resume from another tag "
                                  f"(train.resume_tag=iter_...)")


@dataclass
class ResumePlan:
    """What a resume does: start from ``tag`` (None: a fresh start) after moving ``incomplete`` to
    checkpoints/incomplete/ and ``superseded`` to checkpoints/superseded/."""

    tag: str | None
    incomplete: list[str] = field(default_factory=list)
    superseded: list[str] = field(default_factory=list)
    explicit: bool = False  # ``tag`` is the user's train.resume_tag


def plan_resume(run_dir: str | Path, resume_tag: str | None = None) -> ResumePlan:  # noqa: C901
    """Where a run in ``run_dir`` resumes from (see the module docstring); reads only. Raises CheckpointError for
    every state in which going on could lose a checkpoint or train from the wrong one."""
    root = checkpoint_dir(run_dir)
    tags = scan(run_dir)
    by_name = {t.name: t for t in tags}
    saving = [t.name for t in tags if t.state == "saving"]
    newest = newest_complete(tags)
    if resume_tag is not None and applied_resume_tag(run_dir) == resume_tag:
        # the same command again after train.resume_tag took effect: once this run has saved past that tag, going
        # back again would move its new checkpoints aside on every rerun; it resumes from `latest` instead
        latest, start = read_latest_or_none(run_dir), by_name.get(resume_tag)
        now = by_name.get(latest or "")
        if start is not None and now is not None and now.state == "complete" and now.iteration > start.iteration:
            logger.info("train.resume_tag=%s was applied by an earlier launch of this run; resuming from %s (%s). "
                        "To go back to %s again, delete %s", resume_tag, latest, LATEST, resume_tag,
                        root / APPLIED)
            resume_tag = None
    if resume_tag is not None:  # explicit: `latest` is not consulted at all (it may be the very thing that is lost)
        check_tag(run_dir, resume_tag, "train.resume_tag names")
        verify(run_dir, resume_tag)  # a save that never finished is refused, a damaged file named
        start = by_name.get(resume_tag)
        if start is None:  # a tag not named iter_<n> has no place in the order: nothing is moved
            return ResumePlan(resume_tag, saving, explicit=True)
        later = [t.name for t in tags if t.iteration > start.iteration and t.state != "saving"]
        return ResumePlan(resume_tag, saving, later, explicit=True)
    latest = read_latest(run_dir)
    if latest is None:
        kept = [t for t in tags if t.state != "saving"]
        if not kept:
            return ResumePlan(None, saving)
        if newest is not None:
            raise CheckpointError(f"{root / LATEST} is missing but {root} holds complete checkpoints (the newest is "
                                  f"{newest.name}): resume from it with train.resume_tag={newest.name} (or write "
                                  f"{newest.name} into {root / LATEST}); nothing was deleted. To start afresh, use "
                                  f"another run.dir")
        raise CheckpointError(f"{root / LATEST} is missing and the checkpoints in {root} ("
                              f"{', '.join(t.name for t in kept)}) predate completion records, so which one is whole "
                              f"is unknown: resume from one with train.resume_tag=iter_... (or write its name into "
                              f"{root / LATEST}); nothing was deleted. To start afresh, use another run.dir")
    start = by_name.get(latest)
    if start is None:  # a tag not named iter_<n>: as before, resume from it, nothing moved
        verify(run_dir, latest)
        return ResumePlan(latest)
    if start.state == "saving":
        hint = f"resume from {newest.name} (the newest complete checkpoint) with train.resume_tag={newest.name}" \
            if newest else "delete it to start afresh"
        raise CheckpointError(f"{root / LATEST} names {latest}, whose save never completed (it holds {SAVING} and no "
                              f"{RECORD}): {hint}; nothing was deleted")
    newer_complete = [t.name for t in tags if t.iteration > start.iteration and t.state == "complete"]
    if newer_complete:
        raise CheckpointError(f"{root / LATEST} names {latest} but newer complete checkpoints exist "
                              f"({', '.join(newer_complete)}): to resume from the newest write {newer_complete[-1]} "
                              f"into {root / LATEST}; to go back to {latest} on purpose pass train.resume_tag={latest} "
                              f"(the newer ones are moved to {root / SUPERSEDED}, nothing is deleted)")
    verify(run_dir, latest)
    newer_unmarked = [t.name for t in tags if t.iteration > start.iteration and t.state == "unmarked"]
    return ResumePlan(latest, sorted(saving + newer_unmarked, key=lambda n: by_name[n].iteration))


def move_aside(run_dir: str | Path, tag: str, into: str) -> Path:
    """Move checkpoints/``tag`` to checkpoints/``into``/``tag`` (``tag.1``, ``tag.2``, ... when taken); returns the
    new path. The one way this project takes a tag folder out of a run, other than ``keep_last`` pruning."""
    root = checkpoint_dir(run_dir)
    dest_dir = root / into
    dest_dir.mkdir(exist_ok=True)
    dest, n = dest_dir / tag, 0
    while dest.exists():
        n += 1
        dest = dest_dir / f"{tag}.{n}"
    os.replace(root / tag, dest)
    atomic.fsync_dir(root)
    return dest


def carry_out(run_dir: str | Path, plan: ResumePlan) -> None:
    """Rank 0: the moves of ``plan``, each said in one line."""
    for tag in plan.incomplete:
        dest = move_aside(run_dir, tag, INCOMPLETE)
        logger.warning("moved checkpoint %s, whose save never completed, to %s (not deleted; remove it when you "
                       "no longer need it)", tag, dest)
    for tag in plan.superseded:
        dest = move_aside(run_dir, tag, SUPERSEDED)
        logger.warning("train.resume_tag=%s: moved the newer checkpoint %s to %s (not deleted)", plan.tag, tag, dest)
    if plan.explicit:
        atomic.write_json(checkpoint_dir(run_dir) / APPLIED, {"tag": plan.tag})
        if read_latest_or_none(run_dir) != plan.tag:
            atomic.write_text(checkpoint_dir(run_dir) / LATEST, plan.tag)  # a plain rerun resumes where this run did


def applied_resume_tag(run_dir: str | Path) -> str | None:
    """The train.resume_tag an earlier launch of this run applied, if any."""
    try:
        tag = json.loads((checkpoint_dir(run_dir) / APPLIED).read_bytes())["tag"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return tag if isinstance(tag, str) else None


def read_latest_or_none(run_dir: str | Path) -> str | None:
    """The text of ``checkpoints/latest`` (unchecked), or None when it is missing or not UTF-8."""
    try:
        return (checkpoint_dir(run_dir) / LATEST).read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def begin_save(run_dir: str | Path, tag: str) -> Path:
    """Rank 0, before any rank writes: the tag folder with its ``.saving`` marker (durable). A folder already there
    that never completed is moved aside first; a complete one is never written into (the caller checks)."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    folder = root / tag
    if folder.is_dir() and not folder.is_symlink():
        dest = move_aside(run_dir, tag, INCOMPLETE)
        logger.warning("moved %s, an earlier save of this tag that never completed, to %s (not deleted)", tag, dest)
    folder.mkdir()
    atomic.write_text(folder / SAVING, "a save of this checkpoint is in progress or was interrupted\n")
    return folder


def sync_folder(folder: Path) -> None:
    """``fsync`` every file in ``folder`` and the folder itself: run once per host after the save, it makes what
    every rank of the host wrote durable (the page cache is the host's, whichever process wrote)."""
    for p in sorted(folder.iterdir()):
        if p.is_file() and not p.is_symlink():
            atomic.fsync_file(p)
    atomic.fsync_dir(folder)


def finish_save(run_dir: str | Path, tag: str, iteration: int) -> None:
    """Rank 0, after every rank's files are durable: the completion record (listing every file with its size), then
    the marker removed, then ``latest``."""
    root = checkpoint_dir(run_dir)
    write_record(root / tag, tag, iteration)
    (root / tag / SAVING).unlink(missing_ok=True)
    atomic.write_text(root / LATEST, tag)


def write_record(folder: Path, tag: str, iteration: int) -> None:
    """The completion record of a tag folder whose files are all written and durable: every file and its size."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir())
             if p.is_file() and p.name not in (RECORD, SAVING) and not p.name.startswith(".")}
    atomic.write_json(folder / RECORD, {"tag": tag, "iteration": iteration, "files": files})


def prune(run_dir: str | Path, keep_last: int) -> list[str]:
    """Rank 0, right after a save: remove all but the ``keep_last`` newest checkpoints (the user's own setting), by
    iteration. A save that never finished is never pruned (a resume moves it aside); an unmarked folder here is
    older than the resume tag (newer ones were moved aside), an old-format checkpoint, and is pruned like a complete
    one. Returns the removed tags."""
    whole = [t.name for t in scan(run_dir) if t.state != "saving"]
    removed = whole[:-max(keep_last, 1)]
    for tag in removed:
        shutil.rmtree(checkpoint_dir(run_dir) / tag, ignore_errors=True)
    return removed
