"""Damaging an input and checking what must not have happened: a corpus ``.bin`` damaged (:func:`damage_bin`), a
merges file swapped, a pickle that runs code planted (:func:`plant_evil`, checked by :func:`pwned`); snapshots of a
run before the command and the checks that it is unchanged (:func:`snap_save`, :func:`snap_changed`,
:func:`run_intact`, :func:`nothing_written`, :func:`config_json_unchanged`); the counted rejects of a build.
"""
from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

from tests.hostile.fixtures import BINARY, copy_of, snapshot
from tests.hostile.probe import Probe


def truncate(path: Path, keep: int) -> None:
    """``path`` cut to its first ``keep`` bytes (a negative ``keep``: all but the last ``-keep``), as a killed write
    or a full disk leaves it."""
    path.write_bytes(path.read_bytes()[:keep])


def binary_file(path: Path) -> Path:
    """``path`` (re)written as :data:`~tests.hostile.fixtures.BINARY`, bytes that are not UTF-8; returns it."""
    path.write_bytes(BINARY)
    return path


def flip_byte(path: Path, at: int) -> None:
    """One byte of ``path`` changed in place (same size): a letter becomes its neighbour."""
    data = bytearray(path.read_bytes())
    data[at] = data[at] + 1 if data[at] != 0x7A else 0x79
    path.write_bytes(bytes(data))


def damage_bin(p: Probe, tmp: Path, how: str) -> Path:
    import numpy as np

    c = copy_of(p, "corpus", tmp / "corpus")
    binf = next(c.glob("*.bin"))
    data = np.fromfile(binf, dtype=np.uint16)
    if how == "out_of_range":
        data[len(data) // 2] = 65000
    elif how == "padding_range":
        data[len(data) // 2] = 50260  # >= 50257 ids, < the padded 50304 rows
    elif how == "truncate":
        binf.write_bytes(binf.read_bytes()[: binf.stat().st_size // 2])
        return c
    data.tofile(binf)
    return c

def swap_merges(tok: Path) -> None:
    """Another tokenizer of the same size: two merge rules of the GPT-2 merges file swapped in place."""
    f = tok / "gpt2-merges.txt"
    lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[10], lines[11] = lines[11], lines[10]
    f.write_text("".join(lines), encoding="utf-8")

EVIL = textwrap.dedent("""
    import pickle, sys
    class Evil:
        def __reduce__(self):
            return (open, (sys.argv[2], "w"))
    import torch
    torch.save({"module": Evil()}, sys.argv[1])
""")

def plant_evil(p: Probe, f: Path, marker: Path) -> None:
    res = p.run(["python", "-c", EVIL, str(f), str(marker)], timeout=120)
    if res.rc != 0:
        raise RuntimeError(res.out[-2000:])

def pwned(p, tmp, res):
    return "code in a checkpoint ran" if (tmp / "PWNED").exists() else None

def snap_save(tmp: Path, name: str = "run") -> None:
    import pickle

    (tmp / f"{name}.snap").write_bytes(pickle.dumps(snapshot(tmp / name)))

def snap_changed(tmp: Path, name: str = "run") -> bool:
    import pickle

    return pickle.loads((tmp / f"{name}.snap").read_bytes()) != snapshot(tmp / name)

def keep_config(tmp: Path) -> None:
    shutil.copyfile(tmp / "run" / "config.json", tmp / "config.before")

def config_json_unchanged(p, tmp, res):
    before = (tmp / "config.before").read_text()
    return None if (tmp / "run" / "config.json").read_text() == before else "config.json rewritten by a refused launch"

def nothing_written(p, tmp, res):
    return "a run was written" if (tmp / "run").exists() else None

def run_intact(p, tmp, res):
    run = tmp / "run"
    if not (run / "checkpoints").is_dir():
        return "the run was deleted"
    return "the run was modified" if snap_changed(tmp) else None

def malformed_counted(reason: str):
    """The build went on and counted the bad input as a ``reason`` reject (stats.json ``malformed_by_reason``)."""
    def check(p, tmp, res):
        stats = tmp / "out" / "stats.json"
        if not stats.is_file():
            return "no stats.json"
        n = json.loads(stats.read_text()).get("malformed_by_reason", {}).get(reason, 0)
        return None if n else f"the bad input was not counted as {reason!r}"
    return check

def rejects_counted(kind: str):
    def check(p, tmp, res):
        stats = tmp / "out" / "stats.json"
        if not stats.is_file():
            return "no stats.json"
        return None if kind in stats.read_text() else f"no {kind!r} reject counted in stats.json"
    return check
