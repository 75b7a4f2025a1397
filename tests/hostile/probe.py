"""Running one command of the checkout under test: :class:`Probe` (where the checkout is, its environment, a run
with a timeout, a run interrupted by Ctrl-C), its :class:`Result`, and :class:`Holder` (a live run's lock held
for the duration of a case).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


# --------------------------------------------------------------------------------------------------
# Running one command
# --------------------------------------------------------------------------------------------------
@dataclass
class Result:
    rc: int | None
    out: str
    seconds: float


@dataclass
class Probe:
    """Where the checkout under test is and how to run its commands."""

    root: Path
    base: Path  # scratch folder of this probe run
    python: str = sys.executable
    timeout: float = 150.0
    fixtures: dict[str, Path] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    fixture_log: list[str] = field(default_factory=list)
    holders: dict[str, list] = field(default_factory=dict)  # case folder -> lock holders to stop after it
    extra_env: dict[str, dict[str, str]] = field(default_factory=dict)  # case folder -> environment additions

    def hold(self, tmp: Path, folder: Path) -> None:
        """A live training run's lock on ``folder`` for the duration of the case in ``tmp``."""
        self.holders.setdefault(str(tmp), []).append(Holder(self, folder))

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=str(self.root), DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
                   HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_SILENT="true", OMP_NUM_THREADS="1",
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        env.pop("PYTHONSTARTUP", None)
        env.update(extra)
        return env

    def run(self, args: list[str], cwd: Path | None = None, timeout: float | None = None, stdin: str | None = None,
            **env: str) -> Result:
        """``args`` with ``python`` first replaced by this probe's interpreter; stdout and stderr together."""
        if args and args[0] == "python":
            args = [self.python, *args[1:]]
        elif args and args[0] == "deepspeed":
            args = [str(Path(self.python).parent / "deepspeed"), *args[1:]]
        t0 = time.monotonic()
        proc = subprocess.Popen(args, cwd=cwd or self.root, env=self.env(**env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                start_new_session=True, text=True, errors="replace")
        try:
            out, _ = proc.communicate(stdin, timeout=timeout or self.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, _ = proc.communicate()
            rc = None
        return Result(rc, out or "", time.monotonic() - t0)

    def interrupt(self, args: list[str], marker: Path, timeout: float | None = None, settle: float = 0.0,
                  **env: str) -> Result:
        """``args`` started as a session leader; once ``marker`` exists (a stage has begun) and ``settle`` seconds
        later, SIGINT to its whole process group, as a terminal's Ctrl-C sends it; then wait for it to end."""
        if args and args[0] == "python":
            args = [self.python, *args[1:]]
        elif args and args[0] == "deepspeed":
            args = [str(Path(self.python).parent / "deepspeed"), *args[1:]]
        t0 = time.monotonic()
        limit = timeout or self.timeout
        proc = subprocess.Popen(args, cwd=self.root, env=self.env(**env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, text=True,
                                errors="replace")
        chunks: list[str] = []
        reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
        reader.start()
        while not marker.exists() and proc.poll() is None and time.monotonic() - t0 < limit:
            time.sleep(0.005)
        if proc.poll() is None and marker.exists():
            time.sleep(settle)
            try:
                os.killpg(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=max(1.0, limit - (time.monotonic() - t0)))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
        _kill_group(proc)  # a launcher's ranks may outlive it; a hung build is stopped here
        reader.join(10)
        out = "".join(chunks) + ("" if marker.exists() else f"\n[probe: {marker.name} never appeared]")
        return Result(rc, out, time.monotonic() - t0)

    def configs(self, name: str) -> str:
        return str(self.root / "configs" / name)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(5)
            return
        except subprocess.TimeoutExpired:
            continue


class Holder:
    """A process holding ``folder``'s training-run lock (what a live run does), killed on close."""

    def __init__(self, p: Probe, folder: Path):
        code = ("import sys, time\nfrom training.runtime.run_lock import RunDirLock\n"
                f"RunDirLock({str(folder)!r}).acquire()\nprint('locked', flush=True)\ntime.sleep(900)\n")
        self.proc = subprocess.Popen([p.python, "-c", code], env=p.env(), stdout=subprocess.PIPE, text=True,
                                     cwd=p.root, start_new_session=True)
        line = self.proc.stdout.readline().strip()
        if line != "locked":
            self.close()
            raise RuntimeError(f"could not lock {folder}")

    def close(self) -> None:
        _kill_group(self.proc)
