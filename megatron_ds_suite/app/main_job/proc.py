"""Run one stage's command as a child process: full output to its log file, progress on the console.

The child runs in its own session (process group), so the orchestrator decides how it ends: on Ctrl-C
(or SIGTERM) the whole group gets SIGINT, then SIGTERM after ``grace`` seconds, then SIGKILL; the
DeepSpeed launcher forwards the signal to its ranks. Output is read as bytes and split on ``\\n`` and
``\\r`` (tqdm redraws with ``\\r``) so a :class:`Progress` parser sees every bar update.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

_TQDM = re.compile(r"(?:(?P<desc>[^|\r\n]*?):\s+)?\d+%\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+)")


class Progress:
    """Turns lines of child output into (done, total, label) updates for a console bar.

    ``patterns``: regexes with groups ``n`` and optionally ``total`` and ``label``; ``steps``: regexes
    that each count one step of a fixed ``total`` (e.g. the corpus builder's five sub-stages). tqdm bars
    of the child are followed when ``follow_tqdm`` is set.
    """

    def __init__(self, total: int | None = None, patterns: list[str] | None = None,
                 steps: list[str] | None = None, follow_tqdm: bool = False) -> None:
        self.total, self.n, self.label = total, 0, ""
        self.patterns = [re.compile(p) for p in patterns or []]
        self.steps = [re.compile(p) for p in steps or []]
        self.follow_tqdm = follow_tqdm

    def feed(self, line: str) -> bool:
        """Update from one line; True when something changed."""
        for p in self.steps:
            m = p.search(line)
            if m:
                self.n += 1
                self.label = m.groupdict().get("label") or self.label
                return True
        for p in self.patterns:
            m = p.search(line)
            if m:
                g = m.groupdict()
                self.n = int(g["n"])
                if g.get("total"):
                    self.total = int(g["total"])
                self.label = g.get("label") or self.label
                return True
        if self.follow_tqdm:
            m = _TQDM.search(line)
            if m:
                self.n, self.total = int(m["n"]), int(m["total"])
                self.label = (m["desc"] or "").strip() or self.label
                return True
        return False


def _stop_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGINT, then SIGTERM, then SIGKILL to the child's own process group (it was started by us)."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            # the launcher may exit before its ranks: make sure the group is gone too
            os.killpg(proc.pid, 0)
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def run_logged(cmd: list[str], log_path: Path, env: dict[str, str] | None = None,
               on_update: Callable[[str], None] | None = None, cwd: str | Path | None = None,
               grace: float = 15.0, tail_lines: int = 15) -> tuple[int, list[str]]:
    """Run ``cmd``; returns (exit code, last lines of output). Writes the command and everything the
    child prints to ``log_path`` (overwritten). KeyboardInterrupt stops the child group and re-raises."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail: deque[str] = deque(maxlen=tail_lines)
    with open(log_path, "wb") as log:
        log.write(f"$ {' '.join(cmd)}\n# started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True)
        assert proc.stdout is not None
        buf = b""
        try:
            fd = proc.stdout.fileno()
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                log.write(chunk)
                log.flush()
                buf += chunk
                *lines, buf = re.split(rb"[\r\n]", buf)
                for raw in lines:
                    line = raw.decode("utf-8", "replace")
                    if line.strip():
                        if not _TQDM.search(line):
                            tail.append(line)
                        if on_update is not None:
                            on_update(line)
            rc = proc.wait()
        except BaseException:
            _stop_group(proc, grace)
            log.write(b"\n# interrupted: the orchestrator stopped this process group\n")
            raise
        finally:
            proc.stdout.close()
        if buf.strip():
            tail.append(buf.decode("utf-8", "replace"))
        log.write(f"\n# exit code {rc} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    return rc, list(tail)
