"""Atomic files (megatron_ds_suite.core.atomic): the target is the old file or the whole new one, and a
failure part-way leaves no temporary file behind."""
from __future__ import annotations

import json
import os
import stat
import threading

import numpy as np
import pytest

from megatron_ds_suite.core import atomic


def _listing(d):
    return sorted(p.name for p in d.iterdir())


def test_writes_publish_whole_files(tmp_path):
    assert atomic.write_text(tmp_path / "a" / "b.txt", "héllo\n") == tmp_path / "a" / "b.txt"  # parents created
    assert (tmp_path / "a" / "b.txt").read_text(encoding="utf-8") == "héllo\n"
    atomic.write_bytes(tmp_path / "c.bin", b"\x00\x01")
    assert (tmp_path / "c.bin").read_bytes() == b"\x00\x01"
    atomic.write_json(tmp_path / "d.json", {"b": 1, "a": [1.5, None]})
    assert (tmp_path / "d.json").read_text() == json.dumps({"b": 1, "a": [1.5, None]}, indent=2) + "\n"
    atomic.write_text(tmp_path / "c.bin", "replaced")  # over an existing file
    assert (tmp_path / "c.bin").read_text() == "replaced"
    with atomic.atomic_path(tmp_path / "e.npy") as tmp:  # writers that take a name keep the suffix
        assert tmp.parent == tmp_path and tmp.name.endswith(".npy") and tmp.name.startswith(".e.npy.tmp-")
        np.save(tmp, np.arange(3))
    assert np.load(tmp_path / "e.npy").tolist() == [0, 1, 2]
    atomic.copy_file(tmp_path / "d.json", tmp_path / "f.json")
    assert (tmp_path / "f.json").read_bytes() == (tmp_path / "d.json").read_bytes()
    assert _listing(tmp_path) == ["a", "c.bin", "d.json", "e.npy", "f.json"]  # no temporary file left


def test_failure_mid_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "state.json"
    atomic.write_text(target, "old\n")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with atomic.atomic_open(target) as f:
            f.write("new half")
            f.flush()
            assert target.read_text() == "old\n"  # readers see the old file while the new one is written
            raise RuntimeError("disk on fire")
    assert target.read_text() == "old\n" and _listing(tmp_path) == ["state.json"]
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C part-way is a failure too
        with atomic.atomic_path(target) as tmp:
            tmp.write_text("partial")
            raise KeyboardInterrupt
    assert target.read_text() == "old\n" and _listing(tmp_path) == ["state.json"]
    with pytest.raises(TypeError):  # not serialisable: nothing is touched
        atomic.write_json(target, {"x": object()})
    assert target.read_text() == "old\n" and _listing(tmp_path) == ["state.json"]
    with pytest.raises(FileNotFoundError):
        atomic.copy_file(tmp_path / "missing", target)
    assert target.read_text() == "old\n" and _listing(tmp_path) == ["state.json"]
    new = tmp_path / "never.txt"
    with pytest.raises(ValueError):
        with atomic.atomic_open(new, "wb") as f:
            f.write(b"x")
            raise ValueError("bad")
    assert not new.exists() and _listing(tmp_path) == ["state.json"]


def test_mode_follows_umask_not_mkstemp(tmp_path):
    p = atomic.write_text(tmp_path / "m.txt", "x")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask


def test_concurrent_writers_never_show_a_mixed_file(tmp_path):
    target = tmp_path / "shared.txt"
    payloads = [str(i) * 200_000 for i in range(4)]
    atomic.write_text(target, payloads[0])
    seen: set[str] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.add(target.read_text())

    def write(text: str) -> None:
        for _ in range(10):
            atomic.write_text(target, text)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(t,)) for t in payloads]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert seen and seen <= set(payloads)  # every read is one writer's whole file
    assert target.read_text() in payloads and _listing(tmp_path) == ["shared.txt"]


def test_atomic_open_refuses_append_modes(tmp_path):
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb'"):
        with atomic.atomic_open(tmp_path / "x", "a"):
            pass
    assert _listing(tmp_path) == []


def test_a_killed_folder_writer_leaves_a_temp_folder_the_next_write_removes(tmp_path, caplog):
    """A Hugging Face export (atomic_dir) killed part-way left its hidden ``.out.tmp-*`` folder for good; the next
    write of the same folder removes it (one warning), but never the folder of a writer that is still running."""
    import subprocess
    import sys

    out = tmp_path / "hf"
    code = ("import os, signal, sys, time; from megatron_ds_suite.core import atomic\n"
            "with atomic.atomic_dir(sys.argv[1]) as tmp:\n"
            "    (tmp / 'model.safetensors').write_bytes(b'x' * 1000)\n"
            "    print(tmp, flush=True)\n"
            "    time.sleep(60) if sys.argv[2] == 'live' else os.kill(os.getpid(), signal.SIGKILL)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    live = subprocess.Popen([sys.executable, "-c", code, str(out), "live"], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        live_tmp = live.stdout.readline().strip()
        killed = subprocess.run([sys.executable, "-c", code, str(out), "kill"], cwd=root, capture_output=True,
                                text=True)
        assert killed.returncode == -9
        left = [p for p in tmp_path.iterdir() if p.name.startswith(".hf.tmp-") and str(p) != live_tmp]
        assert len(left) == 1 and (left[0] / "model.safetensors").is_file()  # what the killed export left
        with caplog.at_level("WARNING", logger="megatron_ds_suite.core.atomic"):
            with atomic.atomic_dir(out) as tmp:
                (tmp / "config.json").write_text("{}")
        assert not left[0].exists() and os.path.isdir(live_tmp)  # the live writer's folder is kept
        assert _listing(tmp_path) == sorted(["hf", os.path.basename(live_tmp)]) and _listing(out) == ["config.json"]
        assert [r.getMessage().split(":")[0] for r in caplog.records] == [
            f"removed 1 temporary folder(s) an interrupted write of {out} left"]
    finally:
        live.kill()
        live.wait()
