"""The commands the cases of several families run, built the same way: a corpus build from a config written
beside the case (:func:`data_build`, :func:`jsonl` sources), a two-step training run and its resume
(:func:`train_cmd`, :func:`resume_cmd`), a corpus built and copied once (:func:`built_corpus`); and the
filter of DeepSpeed's own Ctrl-C traceback.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from tests.hostile.fixtures import copy_of, corpus_config, fixture, train_args, write_yaml
from tests.hostile.probe import Probe


def data_build(p: Probe, tmp: Path, sources: list[dict] | None = None, *extra_args: str, cmd: str = "build",
               **cfg) -> list[str]:
    sources = sources if sources is not None else [{"type": "text", "path": str(fixture(p, "text")),
                                                    "text_mode": "blocks"}]
    conf = write_yaml(tmp / "c.yaml", corpus_config(tmp / "out", sources, **cfg))
    return ["python", "-m", "data_pipeline", *cmd.split(), "--config", str(conf), *extra_args]

def jsonl(tmp: Path, lines: list[str | bytes], name: str = "in.jsonl") -> list[dict]:
    good = [json.dumps({"text": f"Document {i}: " + "the quick brown fox jumps over the lazy dog " * 6})
            for i in range(5)]
    f = tmp / name
    with f.open("wb") as fh:
        for line in good + lines:
            fh.write((line.encode() if isinstance(line, str) else line) + b"\n")
    return [{"type": "jsonl", "path": str(f)}]

def built_corpus(p: Probe, tmp: Path) -> tuple[Path, Path]:
    out = copy_of(p, "corpus", tmp / "corpus")
    conf = write_yaml(tmp / "c.yaml", corpus_config(out, [{"type": "text", "path": str(fixture(p, "text")),
                                                           "text_mode": "blocks"}], fixture(p, "tok")))
    return out, conf

def train_cmd(p: Probe, tmp: Path, *over: str, iters: int = 2, corpus: Path | None = None) -> list[str]:
    args = train_args(p, tmp / "run", corpus or fixture(p, "corpus"), iters=iters)
    return args + list(over)

def resume_cmd(p: Probe, tmp: Path, *over: str, iters: int = 3) -> list[str]:
    """Resume a copy of the two-step run for one more step."""
    copy_of(p, "run", tmp / "run")
    return train_cmd(p, tmp, *over, iters=iters)

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def deepspeed_runner_traceback(out: str) -> str:
    """``out`` without the ``deepspeed`` runner's own ``KeyboardInterrupt`` traceback (DeepSpeed's code, waiting in
    ``result.wait()`` when a terminal's Ctrl-C reaches it; documented in docs/errors.md): a traceback block whose
    frames are DeepSpeed's runner and the standard library only."""
    blocks = re.split(r"(?m)^(?=Traceback \(most recent call last\):$)", out)
    kept = []
    for b in blocks:
        body = b.split("\nKeyboardInterrupt", 1)
        own = re.findall(r'File "([^"]+)"', body[0])
        if (b.startswith("Traceback") and len(body) == 2 and any("deepspeed/launcher/runner.py" in f for f in own)
                and not any("/training/" in f or "/megatron_ds_suite/" in f or "/evaluation/" in f for f in own)):
            kept.append("[the deepspeed runner's KeyboardInterrupt traceback, documented in docs/errors.md]" + body[1])
        else:
            kept.append(b)
    return "".join(kept)
