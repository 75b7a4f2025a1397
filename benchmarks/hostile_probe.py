"""Hostile-user probe (issue 30): run the real commands on damaged or wrong inputs and classify what the user sees.

    python -m benchmarks.hostile_probe [--root CHECKOUT] [--only PATTERN] [--jobs N] [--json OUT.json] [--md OUT.md]
    python -m benchmarks.hostile_probe --compare before=BEFORE.json after=AFTER.json [--md OUT.md]

Each case sets itself up in a temporary folder (tiny corpora built by the project's own builder, a two-step TP=1
GPT-2 run, a random transformers GPT-2 imported at TP=2, then damaged copies of them: truncated shards, swapped
tokenizer files, a binary ``latest``, out-of-range token ids, nested JSON lines, a live run held by its lock, ...),
runs one command of the checkout under test (``--root``, default this one) in a subprocess with a timeout, and
classifies the outcome:

- **clean**: where the input is wrong, a non-zero exit with an error line and no traceback; where the right
  answer is to go on (a counted reject, a warning and a rebuild), exit 0 and the documented effect;
- **traceback**: a Python traceback reaches the user (any rank);
- **silent**: exit 0 where the input was wrong, the documented effect missing (e.g. ``skipped 0``), or damage done
  whatever the exit code (a live run modified, a file written outside the output folder, an edited file replaced);
- **hang**: the command ran past its timeout (killed with its process group).

The fixtures are built once per run by the checkout under test (so a checkout before a format change probes its
own files); ``--root`` lets one probe file measure an older checkout (``git worktree add``). Not part of the test
suite: it takes several minutes (docs/errors.md has the command and the last counts).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHARED_DATA", HERE.parent / "shared" / "data"))
if not SHARED.is_dir():
    SHARED = Path("/work/shared/data")
GPT2_TOK = SHARED / "tokenizers" / "gpt2"
SHAKESPEARE = SHARED / "corpus" / "tinyshakespeare.txt"
OUTCOMES = ("clean", "traceback", "silent", "hang")
AREAS = ("data_pipeline", "training", "evaluation", "tools")
BINARY = bytes(range(256)) * 8  # not UTF-8: 0x80 cannot start a character


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


# --------------------------------------------------------------------------------------------------
# Fixtures: built once per probe run, by the checkout under test, then copied by the cases
# --------------------------------------------------------------------------------------------------
def gpt2_spec(tok: Path) -> dict:
    return {"kind": "gpt2_bpe", "vocab_file": str(tok / "gpt2-vocab.json"), "merges_file": str(tok / "gpt2-merges.txt")}


def corpus_config(out: Path, sources: list[dict], tok: Path | None = None, **extra) -> dict:
    """A tiny corpus-builder config: GPT-2 BPE (no tokenizer training), one worker, short documents kept."""
    tok = tok or GPT2_TOK
    cfg = {"output_dir": str(out), "workers": 1, "progress": False, "length": {"min_tokens": 8},
           "sources": sources, "tokenizer": {"type": "gpt2", "vocab_file": str(tok / "gpt2-vocab.json"),
                                             "merges_file": str(tok / "gpt2-merges.txt")}}
    for key, value in extra.items():
        cfg[key] = value
    return cfg


def write_yaml(path: Path, data: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def train_args(p: Probe, run: Path, corpus: Path | None = None, iters: int = 2, **over: str) -> list[str]:
    """``python -m training.pretrain`` of the tiny GPT-2 at TP=1 (2 steps of 2 sequences of 32 tokens)."""
    base = {"run.dir": str(run), "parallel.tensor": "1", "model.seq_length": "32", "train.micro_batch_size": "2",
            "train.global_batch_size": "2", "train.iters": str(iters), "train.save_interval": "2",
            "optimizer.warmup_iters": "1", "train.progress_bar": "false", "train.log_interval": "1"}
    if corpus is not None:
        base["data.corpus"] = str(corpus)
    base.update(over)
    return ["python", "-m", "training.pretrain", "--config", p.configs("gpt2_tiny.yaml"),
            *[f"{k}={v}" for k, v in base.items()]]


RANDOM_GPT2 = textwrap.dedent("""
    import shutil, sys, torch
    from pathlib import Path
    from transformers import GPT2Config, GPT2LMHeadModel
    out, tok = Path(sys.argv[1]), Path(sys.argv[2])
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50257, n_positions=32, n_embd=32, n_layer=1, n_head=2, activation_function="gelu_new")
    GPT2LMHeadModel(cfg).save_pretrained(str(out), safe_serialization=True)
    shutil.copyfile(tok / "gpt2-vocab.json", out / "vocab.json")
    shutil.copyfile(tok / "gpt2-merges.txt", out / "merges.txt")
""")


def _build_fixture(p: Probe, name: str) -> Path:
    fx = p.base / "fixtures"
    fx.mkdir(exist_ok=True)
    path = fx / name
    if name == "text":
        path = fx / "shakespeare.txt"  # 149 blank-line blocks: 149 documents
        path.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20000], encoding="utf-8")
        return path
    if name == "tok":  # a private copy of the GPT-2 files (cases swap or edit copies of it)
        path.mkdir()
        for f in ("gpt2-vocab.json", "gpt2-merges.txt"):
            shutil.copyfile(GPT2_TOK / f, path / f)
        return path
    if name == "corpus":
        text = fixture(p, "text")
        conf = write_yaml(fx / "corpus.yaml", corpus_config(path, [{"type": "text", "path": str(text),
                                                                     "text_mode": "blocks"}], fixture(p, "tok")))
        res = p.run(["python", "-m", "data_pipeline", "build", "--config", str(conf)], timeout=600)
    elif name == "run":
        res = p.run(train_args(p, path, fixture(p, "corpus")), timeout=600)
    elif name == "hf":
        res = p.run(["python", "-c", RANDOM_GPT2, str(path), str(GPT2_TOK)], timeout=300)
    elif name == "run_tp2":
        res = p.run(["python", "-m", "training.tools.import_hf", "--model", str(fixture(p, "hf")), "--out", str(path),
                     "--tp", "2"], timeout=300)
    else:
        raise KeyError(name)
    p.fixture_log.append(f"fixture {name}: rc={res.rc} in {res.seconds:.0f}s")
    if res.rc != 0:
        (fx / f"{name}.failed.log").write_text(res.out)
        lines = error_lines(res.out)
        raise RuntimeError(f"fixture {name} failed (rc={res.rc}, log {fx / name}.failed.log): "
                           f"{lines[-1] if lines else ''}")
    return path


def fixture(p: Probe, name: str) -> Path:
    with p.lock:
        if name not in p.fixtures:
            p.fixtures[name] = _build_fixture(p, name)
        return p.fixtures[name]


def copy_of(p: Probe, name: str, dest: Path) -> Path:
    """A private copy of a fixture, as if it had been built at ``dest``: the absolute paths its bookkeeping
    files hold (a corpus's work folders, a run's own directory) name the copy."""
    src = fixture(p, name)
    shutil.copytree(src, dest, symlinks=True)
    for f in dest.rglob("*"):
        if f.suffix in (".json", ".yaml") and f.is_file() and not f.is_symlink():
            text = f.read_text(errors="surrogateescape")
            if str(src) in text:
                f.write_text(text.replace(str(src), str(dest)), errors="surrogateescape")
    return dest


def latest_tag_dir(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*"))
            if f.is_file() and not f.is_symlink() and f.name != ".lock"}


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


# --------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------
@dataclass
class Case:
    """``setup(probe, tmp)`` returns the command (and optional extra environment and timeout); ``check(probe, tmp,
    result)`` returns a problem (silent damage, a missing documented effect) or None."""

    area: str
    name: str
    defect: str
    expect: str  # "error": must be refused; "ok": must go on (with the documented effect); "either"
    setup: Callable
    check: Callable | None = None
    timeout: float | None = None
    cleanup: Callable | None = None
    interrupt: str | None = None  # a path under the case folder: Ctrl-C to the command's group once it exists
    settle: float = 0.0  # seconds between the path appearing and the Ctrl-C
    foreign: Callable[[str], str] | None = None  # removes output that is not the project's (documented) first


CASES: list[Case] = []


def case(area: str, name: str, defect: str, expect: str = "error", timeout: float | None = None,
         check: Callable | None = None, interrupt: str | None = None, settle: float = 0.0,
         foreign: Callable[[str], str] | None = None):
    def wrap(setup):
        CASES.append(Case(area, name, defect, expect, setup, check, timeout, interrupt=interrupt, settle=settle,
                          foreign=foreign))
        return setup
    return wrap


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


# ---- data_pipeline -------------------------------------------------------------------------------
@case("data_pipeline", "build_ok", "a correct tiny build (control)", "ok")
def _(p, tmp):
    return data_build(p, tmp)


@case("data_pipeline", "config_typo_key", "unknown key `shard_sise` in the corpus config")
def _(p, tmp):
    return data_build(p, tmp, shard_sise=10)


@case("data_pipeline", "config_wrong_type", "`workers: two`")
def _(p, tmp):
    return data_build(p, tmp, workers="two")


@case("data_pipeline", "config_duplicate_key", "a key written twice in the YAML")
def _(p, tmp):
    cmd = data_build(p, tmp)
    conf = Path(cmd[-1])
    conf.write_text(conf.read_text() + "workers: 2\n")
    return cmd


@case("data_pipeline", "config_missing", "--config names no file")
def _(p, tmp):
    return ["python", "-m", "data_pipeline", "build", "--config", str(tmp / "nope.yaml")]


@case("data_pipeline", "config_binary", "--config is a binary file")
def _(p, tmp):
    (tmp / "c.yaml").write_bytes(BINARY)
    return ["python", "-m", "data_pipeline", "build", "--config", str(tmp / "c.yaml")]


@case("data_pipeline", "config_is_list", "the YAML is a list, not a mapping")
def _(p, tmp):
    (tmp / "c.yaml").write_text("- a\n- b\n")
    return ["python", "-m", "data_pipeline", "build", "--config", str(tmp / "c.yaml")]


@case("data_pipeline", "config_yaml_syntax", "a YAML syntax error")
def _(p, tmp):
    (tmp / "c.yaml").write_text("output_dir: [unclosed\nworkers: 1\n")
    return ["python", "-m", "data_pipeline", "build", "--config", str(tmp / "c.yaml")]


@case("data_pipeline", "override_no_equals", "an override without `=`")
def _(p, tmp):
    return data_build(p, tmp, None, "dedup.threshold")


@case("data_pipeline", "override_unknown_section", "override `nosuch.key=1`")
def _(p, tmp):
    return data_build(p, tmp, None, "nosuch.key=1")


@case("data_pipeline", "dedup_threshold_range", "`dedup.threshold=1.5`")
def _(p, tmp):
    return data_build(p, tmp, None, "dedup.threshold=1.5")


@case("data_pipeline", "shard_size_zero", "`shard_size=0`")
def _(p, tmp):
    return data_build(p, tmp, None, "shard_size=0")


@case("data_pipeline", "vocab_too_small", "SentencePiece `tokenizer.vocab_size=5`")
def _(p, tmp):
    return data_build(p, tmp, None, "tokenizer.type=sentencepiece", "tokenizer.vocab_size=5",
                      "tokenizer.vocab_file=null", "tokenizer.merges_file=null")


@case("data_pipeline", "vocab_too_large", "SentencePiece vocabulary larger than the corpus allows")
def _(p, tmp):
    return data_build(p, tmp, None, "tokenizer.type=sentencepiece", "tokenizer.vocab_size=60000",
                      "tokenizer.vocab_file=null", "tokenizer.merges_file=null")


@case("data_pipeline", "tokenizer_files_missing", "tokenizer.vocab_file names no file")
def _(p, tmp):
    return data_build(p, tmp, None, f"tokenizer.vocab_file={tmp / 'none.json'}")


@case("data_pipeline", "tokenizer_vocab_binary", "tokenizer.vocab_file is a binary file")
def _(p, tmp):
    (tmp / "v.json").write_bytes(BINARY)
    return data_build(p, tmp, None, f"tokenizer.vocab_file={tmp / 'v.json'}")


@case("data_pipeline", "source_missing", "a source path that does not exist")
def _(p, tmp):
    return data_build(p, tmp, [{"type": "jsonl", "path": str(tmp / "nowhere.jsonl")}])


@case("data_pipeline", "source_empty_file", "a jsonl source with no record")
def _(p, tmp):
    (tmp / "e.jsonl").write_text("")
    return data_build(p, tmp, [{"type": "jsonl", "path": str(tmp / "e.jsonl")}])


@case("data_pipeline", "source_unknown_type", "`type: csv`")
def _(p, tmp):
    return data_build(p, tmp, [{"type": "csv", "path": str(fixture(p, "text"))}])


@case("data_pipeline", "binary_as_text_source", "a binary file given as a text source", "either",
      check=malformed_counted("invalid_utf8"))
def _(p, tmp):
    (tmp / "blob.txt").write_bytes(BINARY * 4)
    return data_build(p, tmp, [{"type": "text", "path": str(tmp / "blob.txt")},
                               {"type": "text", "path": str(fixture(p, "text")), "text_mode": "blocks"}])


@case("data_pipeline", "binary_as_jsonl_source", "a binary line in a .jsonl", "either",
      check=malformed_counted("invalid_utf8"))
def _(p, tmp):
    return data_build(p, tmp, jsonl(tmp, [BINARY[128:400]]))


@case("data_pipeline", "gzip_named_jsonl", "gzip bytes in a .jsonl without .gz", "either",
      check=malformed_counted("invalid_utf8"))
def _(p, tmp):
    import gzip

    src = jsonl(tmp, [])
    f = Path(src[0]["path"])
    (tmp / "z.jsonl").write_bytes(gzip.compress(f.read_bytes()))
    return data_build(p, tmp, [{"type": "jsonl", "path": str(tmp / "z.jsonl")}] + src)


@case("data_pipeline", "deeply_nested_json", "one 2 KB line nested 1,000 deep among good lines", "ok",
      check=rejects_counted("bad_json"))
def _(p, tmp):
    return data_build(p, tmp, jsonl(tmp, ["[" * 1000 + "]" * 1000]))


@case("data_pipeline", "deeply_nested_text_field", "a record whose text is a 1,000-deep object", "ok",
      check=malformed_counted("bad_json"))
def _(p, tmp):
    return data_build(p, tmp, jsonl(tmp, ['{"text": ' + "{\"a\": " * 1000 + "1" + "}" * 1000 + "}"]))


@case("data_pipeline", "malformed_json_line", "a cut JSON line", "ok", check=rejects_counted("bad_json"))
def _(p, tmp):
    return data_build(p, tmp, jsonl(tmp, ['{"text": "cut sho']))


@case("data_pipeline", "text_not_string", "`text` is a number / null / list", "ok",
      check=malformed_counted("non_string_field"))
def _(p, tmp):
    return data_build(p, tmp, jsonl(tmp, ['{"text": 12}', '{"text": null}', '{"text": ["a"]}', '"just a string"']))


@case("data_pipeline", "huge_number_json", "a JSON number with 100,000 digits in one line", "ok",
      check=malformed_counted("bad_json"))
def _(p, tmp):
    return data_build(p, tmp, jsonl(tmp, ['{"text": "x", "n": ' + "9" * 100000 + "}"]))


@case("data_pipeline", "latin1_text_source", "a Latin-1 (not UTF-8) text file", "either",
      check=malformed_counted("invalid_utf8"))
def _(p, tmp):
    (tmp / "l.txt").write_bytes(("caf\xe9 na\xefve " * 400).encode("latin-1"))
    return data_build(p, tmp, [{"type": "text", "path": str(tmp / "l.txt")},
                               {"type": "text", "path": str(fixture(p, "text")), "text_mode": "blocks"}])


@case("data_pipeline", "workers_negative", "`workers=-1` (all cores, as joblib reads it, or refused)", "either")
def _(p, tmp):
    return data_build(p, tmp, None, "workers=-1")


@case("data_pipeline", "source_is_directory_of_binaries", "a jsonl source folder holding only .bin files")
def _(p, tmp):
    (tmp / "d").mkdir()
    (tmp / "d" / "a.bin").write_bytes(BINARY)
    return data_build(p, tmp, [{"type": "jsonl", "path": str(tmp / "d")}])


def _warned_once(p, tmp, res):
    n = sum("not read" in line for line in res.out.splitlines())
    return None if n == 1 else f"the 'file(s) not read' warning appears {n} times"


@case("data_pipeline", "dir_source_stray_file", "a jsonl folder holding a README, read as 5 one-record shards",
      "ok", check=_warned_once)
def _(p, tmp):
    d = tmp / "in"
    d.mkdir()
    shutil.copyfile(jsonl(tmp, [])[0]["path"], d / "a.jsonl")
    (d / "README.md").write_text("what this folder holds\n")
    return data_build(p, tmp, [{"type": "jsonl", "path": str(d)}], "shard_size=1")


@case("data_pipeline", "prefix_escapes_output", "`dataset.gpt_prefix=../x`",
      check=lambda p, tmp, res: "wrote outside the output folder" if list(tmp.glob("x.*")) else None)
def _(p, tmp):
    return data_build(p, tmp, None, "dataset.gpt_prefix=../x")


@case("data_pipeline", "prefix_absolute", "`dataset.gpt_prefix=/abs/path`",
      check=lambda p, tmp, res: "wrote outside the output folder" if list((tmp / "abs").glob("y.*")) else None)
def _(p, tmp):
    (tmp / "abs").mkdir()
    return data_build(p, tmp, None, f"dataset.gpt_prefix={tmp / 'abs' / 'y'}")


@case("data_pipeline", "prefixes_equal", "gpt_prefix == bert_prefix with both datasets on")
def _(p, tmp):
    return data_build(p, tmp, None, "dataset.bert=true", "dataset.gpt_prefix=same", "dataset.bert_prefix=same")


@case("data_pipeline", "output_dir_is_file", "output_dir is an existing file")
def _(p, tmp):
    cmd = data_build(p, tmp)
    (tmp / "out").write_text("not a folder")
    return cmd


@case("data_pipeline", "hf_source_not_dataset", "`type: hf` on a folder that is not a dataset")
def _(p, tmp):
    (tmp / "notds").mkdir()
    (tmp / "notds" / "readme.md").write_text("hello")
    return data_build(p, tmp, [{"type": "hf", "path": str(tmp / "notds")},
                               {"type": "text", "path": str(fixture(p, "text")), "text_mode": "blocks"}])


@case("data_pipeline", "hf_source_loading_script", "`type: hf` naming a loading script (would run code)",
      check=lambda p, tmp, res: "the loading script ran" if (tmp / "PWNED").exists() else None)
def _(p, tmp):
    (tmp / "ds").mkdir()
    (tmp / "ds" / "ds.py").write_text(f"open({str(tmp / 'PWNED')!r}, 'w').write('x')\n")
    return data_build(p, tmp, [{"type": "hf", "path": str(tmp / "ds")}])


@case("data_pipeline", "parquet_no_text_column", "a parquet file without the text column")
def _(p, tmp):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a b c"] * 5}), tmp / "t.parquet")
    return data_build(p, tmp, [{"type": "parquet", "path": str(tmp / "t.parquet")}])


def _built(p: Probe, tmp: Path) -> tuple[Path, Path]:
    out = copy_of(p, "corpus", tmp / "corpus")
    conf = write_yaml(tmp / "c.yaml", corpus_config(out, [{"type": "text", "path": str(fixture(p, "text")),
                                                           "text_mode": "blocks"}], fixture(p, "tok")))
    return out, conf


def _first_shard(out: Path) -> Path:
    """The ingest store's first text shard: ``docs-00000.txt`` (UTF-8 texts + offsets, since the binary store) or
    ``docs-00000.jsonl`` (older checkouts probed with --root)."""
    txt = out / "work" / "ingest" / "docs-00000.txt"
    return txt if txt.is_file() else out / "work" / "ingest" / "docs-00000.jsonl"


@case("data_pipeline", "truncated_shard", "a finished stage's shard cut short, then `stage dedup`")
def _(p, tmp):
    out, conf = _built(p, tmp)
    shard = _first_shard(out)  # the filter and dedup stages read its texts
    shard.write_bytes(shard.read_bytes()[:100])
    for d in (out / "work").glob("signatures-*"):
        shutil.rmtree(d)
    return ["python", "-m", "data_pipeline", "stage", "dedup", "--config", str(conf)]


@case("data_pipeline", "missing_shard", "a finished stage's shard deleted, then `stage dedup`")
def _(p, tmp):
    out, conf = _built(p, tmp)
    _first_shard(out).unlink()
    for d in (out / "work").glob("signatures-*"):
        shutil.rmtree(d)
    return ["python", "-m", "data_pipeline", "stage", "dedup", "--config", str(conf)]


@case("data_pipeline", "stage_unknown", "`stage nosuch`")
def _(p, tmp):
    out, conf = _built(p, tmp)
    return ["python", "-m", "data_pipeline", "stage", "nosuch", "--config", str(conf)]


@case("data_pipeline", "status_fresh", "`status` of a config never built (control)", "ok")
def _(p, tmp):
    return data_build(p, tmp, cmd="status")


@case("data_pipeline", "rebuild_is_noop", "`build` again on a finished corpus (control)", "ok")
def _(p, tmp):
    out, conf = _built(p, tmp)
    return ["python", "-m", "data_pipeline", "build", "--config", str(conf)]


@case("data_pipeline", "overlap_binary_eval", "a binary evaluation file given to `overlap`")
def _(p, tmp):
    (tmp / "set.tokens").write_bytes(BINARY)
    src = jsonl(tmp, [])
    return ["python", "-m", "data_pipeline", "overlap", "--corpus", src[0]["path"], "--against",
            f"x={tmp / 'set.tokens'}", "--workers", "1"]


@case("data_pipeline", "overlap_binary_corpus", "a binary line in the corpus given to `overlap`")
def _(p, tmp):
    (tmp / "set.tokens").write_text("a b c d e f g h i j\n")
    src = jsonl(tmp, [BINARY[128:300]])
    return ["python", "-m", "data_pipeline", "overlap", "--corpus", src[0]["path"], "--against",
            f"x={tmp / 'set.tokens'}", "--workers", "1"]


@case("data_pipeline", "overlap_missing_corpus", "`overlap --corpus` names nothing")
def _(p, tmp):
    (tmp / "set.tokens").write_text("a b c d e f g h i j\n")
    return ["python", "-m", "data_pipeline", "overlap", "--corpus", str(tmp / "none"), "--against",
            f"x={tmp / 'set.tokens'}", "--workers", "1"]


@case("data_pipeline", "overlap_eval_set_nested_line", "an overlap eval set (jsonl) with a line nested 1,000 deep")
def _(p, tmp):
    (tmp / "set.jsonl").write_text(json.dumps({"text": "a b c d e f g h i j"}) + "\n" + "[" * 1000 + "]" * 1000 + "\n")
    src = jsonl(tmp, [])
    return ["python", "-m", "data_pipeline", "overlap", "--corpus", src[0]["path"], "--against",
            f"x={tmp / 'set.jsonl'}", "--workers", "1"]


@case("data_pipeline", "overlap_corpus_huge_number", "an overlap corpus line holding a 100,000-digit number")
def _(p, tmp):
    (tmp / "set.tokens").write_text("a b c d e f g h i j\n")
    src = jsonl(tmp, ['{"text": "x", "n": ' + "9" * 100000 + "}"])
    return ["python", "-m", "data_pipeline", "overlap", "--corpus", src[0]["path"], "--against",
            f"x={tmp / 'set.tokens'}", "--workers", "1"]


@case("data_pipeline", "overlap_against_no_equals", "`overlap --against FILE` without NAME=")
def _(p, tmp):
    src = jsonl(tmp, [])
    return ["python", "-m", "data_pipeline", "overlap", "--corpus", src[0]["path"], "--against", src[0]["path"]]


# ---- data_pipeline: the corpus store (issue 38, class 3) -----------------------------------------------
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


def _flip_byte(path: Path, at: int) -> None:
    """One byte of ``path`` changed in place (same size): a letter becomes its neighbour."""
    data = bytearray(path.read_bytes())
    data[at] = data[at] + 1 if data[at] != 0x7A else 0x79
    path.write_bytes(bytes(data))


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
    f.write_bytes(f.read_bytes()[:-60])
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
    _flip_byte(f, next(i for i in range(len(text) // 2, len(text)) if 0x61 <= text[i] <= 0x7A))
    return _corpus_cmd(conf, "stage", "export")


@case("data_pipeline", "store_flipped_byte_tokens", "one byte of a filter shard's token ids (`.tok.npy`) changed, "
      "then `stage export`")
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    f = out / "work" / "filter" / "docs-00000.tok.npy"
    _flip_byte(f, len(f.read_bytes()) - 7)
    return _corpus_cmd(conf, "stage", "export")


@case("data_pipeline", "store_flipped_byte_meta", "one byte of an ingest shard's `.meta.jsonl` changed, then "
      "`stage export`")
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    f = out / "work" / "ingest" / "docs-00002.meta.jsonl"
    text = f.read_bytes()
    _flip_byte(f, text.rindex(b"blocks") if b"blocks" in text else len(text) - 10)
    return _corpus_cmd(conf, "stage", "export")


@case("data_pipeline", "stage_json_damaged", "binary bytes in `work/filter/_stage.json`, then `build`")
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    (out / "work" / "filter" / "_stage.json").write_bytes(BINARY)
    return _corpus_cmd(conf, "build")


@case("data_pipeline", "stage_json_damaged_force", "`work/ingest/_stage.json` cut in half, then `build --force` "
      "(repairs it)", "ok", check=_same_documents)
def _(p, tmp):
    out, conf = _sharded(p, tmp)
    f = out / "work" / "ingest" / "_stage.json"
    f.write_bytes(f.read_bytes()[:40])
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
    f.write_bytes(f.read_bytes()[:100])
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
    out, conf = _built(p, tmp)
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


# ---- training --------------------------------------------------------------------------------------
def _train(p: Probe, tmp: Path, *over: str, iters: int = 2, corpus: Path | None = None) -> list[str]:
    args = train_args(p, tmp / "run", corpus or fixture(p, "corpus"), iters=iters)
    return args + list(over)


def _resume(p: Probe, tmp: Path, *over: str, iters: int = 3) -> list[str]:
    """Resume a copy of the two-step run for one more step."""
    copy_of(p, "run", tmp / "run")
    return _train(p, tmp, *over, iters=iters)


def config_json_unchanged(p, tmp, res):
    before = (tmp / "config.before").read_text()
    return None if (tmp / "run" / "config.json").read_text() == before else "config.json rewritten by a refused launch"


def _keep_config(tmp: Path) -> None:
    shutil.copyfile(tmp / "run" / "config.json", tmp / "config.before")


@case("training", "train_ok", "a correct two-step run (control)", "ok")
def _(p, tmp):
    return _train(p, tmp)


@case("training", "config_typo_key", "`train.iter=5` (typo of iters)")
def _(p, tmp):
    return _train(p, tmp, "train.iter=5")


@case("training", "config_missing", "--config names no file")
def _(p, tmp):
    return ["python", "-m", "training.pretrain", "--config", str(tmp / "nope.yaml")]


@case("training", "config_binary", "--config is a binary file")
def _(p, tmp):
    (tmp / "c.yaml").write_bytes(BINARY)
    return ["python", "-m", "training.pretrain", "--config", str(tmp / "c.yaml")]


@case("training", "override_no_equals", "an override without `=`")
def _(p, tmp):
    return _train(p, tmp, "train.iters")


@case("training", "wrong_type", "`train.iters=many`")
def _(p, tmp):
    return _train(p, tmp, "train.iters=many")


@case("training", "negative_save_interval", "`train.save_interval=-1` (saved every step)")
def _(p, tmp):
    return _train(p, tmp, "train.save_interval=-1")


@case("training", "negative_eval_interval", "`train.eval_interval=-1`")
def _(p, tmp):
    return _train(p, tmp, "train.eval_interval=-1")


@case("training", "negative_log_interval", "`train.log_interval=-1`")
def _(p, tmp):
    return _train(p, tmp, "train.log_interval=-1")


@case("training", "keep_last_zero", "`train.keep_last=0`")
def _(p, tmp):
    return _train(p, tmp, "train.keep_last=0")


@case("training", "negative_lr", "`optimizer.lr=-1`")
def _(p, tmp):
    return _train(p, tmp, "optimizer.lr=-1")


@case("training", "batch_not_divisible", "global batch 3 with micro batch 2")
def _(p, tmp):
    return _train(p, tmp, "train.global_batch_size=3")


@case("training", "tp_not_dividing_heads", "`parallel.tensor=3` with 4 heads")
def _(p, tmp):
    return _train(p, tmp, "parallel.tensor=3")


@case("training", "iters_negative", "`train.iters=-5`")
def _(p, tmp):
    return _train(p, tmp, "train.iters=-5")


@case("training", "num_layers_zero", "`model.num_layers=0`")
def _(p, tmp):
    return _train(p, tmp, "model.num_layers=0")


@case("training", "seq_length_zero", "`model.seq_length=0`")
def _(p, tmp):
    return _train(p, tmp, "model.seq_length=0")


@case("training", "split_no_train", "`data.split=0,0,1`")
def _(p, tmp):
    return _train(p, tmp, "data.split=0,0,1")


@case("training", "no_data", "`data.corpus=null` and no other data")
def _(p, tmp):
    return _train(p, tmp, "data.corpus=null")


def _text_files(p: Probe, tmp: Path, f: Path) -> list[str]:
    return _train(p, tmp, "data.corpus=null", f"data.text_files=[{f}]",
                  f"data.tokenizer={json.dumps(gpt2_spec(fixture(p, 'tok')))}")


@case("training", "text_file_binary", "a binary `data.text_files` entry")
def _(p, tmp):
    (tmp / "b.txt").write_bytes(BINARY)
    return _text_files(p, tmp, tmp / "b.txt")


@case("training", "text_file_empty", "an empty `data.text_files` entry")
def _(p, tmp):
    (tmp / "e.txt").write_text("")
    return _text_files(p, tmp, tmp / "e.txt")


@case("training", "text_file_missing", "a `data.text_files` entry that does not exist")
def _(p, tmp):
    return _text_files(p, tmp, tmp / "none.txt")


@case("training", "corpus_not_a_corpus", "`data.corpus` an empty folder")
def _(p, tmp):
    (tmp / "empty").mkdir()
    return _train(p, tmp, corpus=tmp / "empty")


@case("training", "corpus_json_binary", "a binary corpus.json")
def _(p, tmp):
    c = copy_of(p, "corpus", tmp / "corpus")
    (c / "corpus.json").write_bytes(BINARY)
    return _train(p, tmp, corpus=c)


def _damage_bin(p: Probe, tmp: Path, how: str) -> Path:
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


@case("training", "token_ids_out_of_range", "a token id 65000 in the corpus .bin (vocabulary 50257)")
def _(p, tmp):
    return _train(p, tmp, corpus=_damage_bin(p, tmp, "out_of_range"))


@case("training", "token_ids_padding_range", "a token id in the model's vocabulary padding (50260)")
def _(p, tmp):
    return _train(p, tmp, corpus=_damage_bin(p, tmp, "padding_range"))


@case("training", "bin_truncated", "the corpus .bin cut in half")
def _(p, tmp):
    return _train(p, tmp, corpus=_damage_bin(p, tmp, "truncate"))


@case("training", "idx_zeroed", "the corpus .idx zeroed after its header")
def _(p, tmp):
    c = copy_of(p, "corpus", tmp / "corpus")
    idx = next(c.glob("*.idx"))
    raw = bytearray(idx.read_bytes())
    raw[40:] = bytes(len(raw) - 40)
    idx.write_bytes(bytes(raw))
    return _train(p, tmp, corpus=c)


def swap_merges(tok: Path) -> None:
    """Another tokenizer of the same size: two merge rules of the GPT-2 merges file swapped in place."""
    f = tok / "gpt2-merges.txt"
    lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[10], lines[11] = lines[11], lines[10]
    f.write_text("".join(lines), encoding="utf-8")


@case("training", "tokenizer_swapped_same_size", "the corpus's merges file edited after the build (same size)")
def _(p, tmp):
    c = copy_of(p, "corpus", tmp / "corpus")
    swap_merges(c / "tokenizer")
    return _train(p, tmp, corpus=c)


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
    return _train(p, tmp, iters=3, corpus=c)


@case("training", "resume_binary_latest", "resume with a binary checkpoints/latest", check=config_json_unchanged)
def _(p, tmp):
    cmd = _resume(p, tmp, "optimizer.lr=5e-4")
    _keep_config(tmp)
    (tmp / "run" / "checkpoints" / "latest").write_bytes(b"\x80\x81\xfe\x00")
    return cmd


@case("training", "resume_latest_missing_tag", "checkpoints/latest names a tag that is gone", check=config_json_unchanged)
def _(p, tmp):
    cmd = _resume(p, tmp, "optimizer.lr=5e-4")
    _keep_config(tmp)
    (tmp / "run" / "checkpoints" / "latest").write_text("iter_0000009")
    return cmd


@case("training", "resume_latest_escapes", "checkpoints/latest names `../../elsewhere`")
def _(p, tmp):
    cmd = _resume(p, tmp)
    (tmp / "elsewhere").mkdir()
    (tmp / "run" / "checkpoints" / "latest").write_text("../../elsewhere")
    return cmd


@case("training", "resume_symlinked_tag", "the latest tag folder is a symlink to a copy elsewhere")
def _(p, tmp):
    cmd = _resume(p, tmp)
    tag = latest_tag_dir(tmp / "run")
    shutil.move(str(tag), tmp / "moved")
    tag.symlink_to(tmp / "moved")
    return cmd


@case("training", "resume_truncated_model_file", "the model states file of the latest tag cut short")
def _(p, tmp):
    cmd = _resume(p, tmp)
    f = next(latest_tag_dir(tmp / "run").glob("mp_rank_00_model_states.pt"))
    f.write_bytes(f.read_bytes()[:4096])
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
    cmd = _resume(p, tmp)
    (tmp / "run" / "checkpoints" / "latest").unlink()
    _keep_ckpts(tmp)
    return cmd


@case("training", "resume_latest_deleted_two_tags", "checkpoints/latest lost, two complete checkpoints",
      check=ckpts_kept)
def _(p, tmp):
    cmd = _resume(p, tmp)
    _second_tag(tmp / "run", "iter_0000001")
    (tmp / "run" / "checkpoints" / "latest").unlink()
    _keep_ckpts(tmp)
    return cmd


@case("training", "resume_latest_rolled_back", "checkpoints/latest pointed at an older tag by hand",
      check=ckpts_kept)
def _(p, tmp):
    cmd = _resume(p, tmp)
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
    cmd = _resume(p, tmp, "train.resume_tag=iter_0000001")
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
    cmd = _resume(p, tmp, "train.resume_tag=iter_0000002")
    (tmp / "run" / "checkpoints" / "latest").unlink()
    _keep_ckpts(tmp)
    return cmd


@case("training", "resume_zero_byte_model_file", "the model states file of the latest tag emptied (0 bytes)")
def _(p, tmp):
    cmd = _resume(p, tmp)
    (latest_tag_dir(tmp / "run") / "mp_rank_00_model_states.pt").write_bytes(b"")
    return cmd


@case("training", "resume_model_file_grown", "the model states file of the latest tag replaced by a longer one "
      "(junk appended)")
def _(p, tmp):
    cmd = _resume(p, tmp)
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
    cmd = _resume(p, tmp, iters=4)
    torn = tmp / "run" / "checkpoints" / "iter_0000003"
    torn.mkdir()
    (torn / ".saving").write_text("")
    (torn / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04 cut")
    return cmd


EVIL = textwrap.dedent("""
    import pickle, sys
    class Evil:
        def __reduce__(self):
            return (open, (sys.argv[2], "w"))
    import torch
    torch.save({"module": Evil()}, sys.argv[1])
""")


def _plant_evil(p: Probe, f: Path, marker: Path) -> None:
    res = p.run(["python", "-c", EVIL, str(f), str(marker)], timeout=120)
    if res.rc != 0:
        raise RuntimeError(res.out[-2000:])


def pwned(p, tmp, res):
    return "code in a checkpoint ran" if (tmp / "PWNED").exists() else None


@case("training", "resume_malicious_pickle", "a model file whose pickle runs code", check=pwned)
def _(p, tmp):
    cmd = _resume(p, tmp)
    _plant_evil(p, latest_tag_dir(tmp / "run") / "mp_rank_00_model_states.pt", tmp / "PWNED")
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
    return _train(p, tmp)


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
    cmd = _resume(p, tmp)
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
      check=lambda p, tmp, res: "the live run's files changed" if _snap_changed(tmp) else None)
def _(p, tmp):
    cmd = _resume(p, tmp)
    _snap_save(tmp)
    p.hold(tmp, tmp / "run")
    return cmd


def _snap_save(tmp: Path, name: str = "run") -> None:
    import pickle

    (tmp / f"{name}.snap").write_bytes(pickle.dumps(snapshot(tmp / name)))


def _snap_changed(tmp: Path, name: str = "run") -> bool:
    import pickle

    return pickle.loads((tmp / f"{name}.snap").read_bytes()) != snapshot(tmp / name)


@case("training", "stale_lock", "a lock left by a killed run (pid gone)", "ok")
def _(p, tmp):
    cmd = _resume(p, tmp)
    holder = Holder(p, tmp / "run")
    holder.proc.kill()
    holder.proc.wait()
    return cmd


@case("training", "deepspeed_typo_top", "`deepspeed.wall_clock_breakdwn=true` (typo)")
def _(p, tmp):
    return _train(p, tmp, "deepspeed.wall_clock_breakdwn=true")


@case("training", "deepspeed_typo_nested", "`deepspeed.zero_optimization.overlap_com=true` (typo)")
def _(p, tmp):
    return _train(p, tmp, "deepspeed.zero_optimization={\"overlap_com\": true}")


@case("training", "deepspeed_wrong_type", "`deepspeed.steps_per_print=often`")
def _(p, tmp):
    return _train(p, tmp, "deepspeed.steps_per_print=often")


@case("training", "init_from_self", "`train.init_from` = run.dir")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    return _train(p, tmp, f"train.init_from={run}")


def _unchanged_source(p, tmp, res):
    if not (tmp / "src").is_dir():
        return "the source run was deleted"
    return "the source run was written into" if _snap_changed(tmp, "src") else None


@case("training", "init_from_inside_run_dir", "`train.init_from` a run inside run.dir (run.dir its ancestor)",
      check=_unchanged_source)
def _(p, tmp):
    copy_of(p, "run", tmp / "src")
    _snap_save(tmp, "src")
    return train_args(p, tmp, fixture(p, "corpus"), 2, **{"train.init_from": str(tmp / "src")})


@case("training", "init_from_ancestor_of_run_dir", "`run.dir` inside the `train.init_from` run",
      check=_unchanged_source)
def _(p, tmp):
    copy_of(p, "run", tmp / "src")
    _snap_save(tmp, "src")
    return train_args(p, tmp / "src" / "finetuned", fixture(p, "corpus"), 2, **{"train.init_from": str(tmp / "src")})


@case("training", "init_from_missing", "`train.init_from` names no run")
def _(p, tmp):
    return _train(p, tmp, f"train.init_from={tmp / 'none'}")


@case("training", "init_from_corpus", "`train.init_from` a corpus folder")
def _(p, tmp):
    return _train(p, tmp, f"train.init_from={fixture(p, 'corpus')}")


@case("training", "init_from_binary_latest", "`train.init_from` a run with a binary latest")
def _(p, tmp):
    src = copy_of(p, "run", tmp / "src")
    (src / "checkpoints" / "latest").write_bytes(b"\x80\x81\xfe\x00")
    return _train(p, tmp, f"train.init_from={src}")


@case("training", "pipeline_without_ranks", "`parallel.pipeline=2` in a single process")
def _(p, tmp):
    return _train(p, tmp, "parallel.pipeline=2")


@case("training", "wandb_unreachable", "`run.wandb.mode=online` with the W&B server unreachable", "ok", timeout=150)
def _(p, tmp):
    p.extra_env[str(tmp)] = {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "x" * 40}
    return _train(p, tmp, "run.wandb.enabled=true", "run.wandb.mode=online", "run.wandb.project=probe")


@case("training", "tp2_token_ids_out_of_range", "TP=2 under the launcher, a token id 65000 in the .bin",
      timeout=300)
def _(p, tmp):
    c = _damage_bin(p, tmp, "out_of_range")
    args = train_args(p, tmp / "run", c, 2, **{"parallel.tensor": "2"})
    return ["deepspeed", "--num_gpus", "2", "--master_port", str(_free_port()), "--module", *args[2:]]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@case("training", "finetune_race_into_pretrained_subfolder", "RACE `run.dir` inside `finetune.pretrained`",
      check=_unchanged_source)
def _(p, tmp):
    copy_of(p, "run", tmp / "src")
    _snap_save(tmp, "src")
    return ["python", "-m", "training.finetune_race", "--config", p.configs("race.yaml"),
            f"finetune.pretrained={tmp / 'src'}", f"run.dir={tmp / 'src' / 'race'}", "parallel.tensor=1"]


@case("training", "finetune_race_from_gpt", "RACE fine-tuning of a GPT-2 checkpoint")
def _(p, tmp):
    return ["python", "-m", "training.finetune_race", "--config", p.configs("race.yaml"),
            f"finetune.pretrained={fixture(p, 'run')}", f"run.dir={tmp / 'race'}", "parallel.tensor=1"]


@case("training", "finetune_race_missing_pretrained", "`finetune.pretrained` names no run")
def _(p, tmp):
    return ["python", "-m", "training.finetune_race", "--config", p.configs("race.yaml"),
            f"finetune.pretrained={tmp / 'none'}", f"run.dir={tmp / 'race'}", "parallel.tensor=1"]


@case("training", "lr_nan", "`optimizer.lr=.nan` (passed `lr > 0` checks: NaN compares false)")
def _(p, tmp):
    return train_args(p, tmp / "run", fixture(p, "corpus"), **{"optimizer.lr": ".nan"})


@case("training", "lr_inf", "`optimizer.lr=.inf`")
def _(p, tmp):
    return train_args(p, tmp / "run", fixture(p, "corpus"), **{"optimizer.lr": ".inf"})


@case("training", "layernorm_eps_negative", "`model.layernorm_epsilon=-1e-5` (the NaN loss was blamed on the lr)")
def _(p, tmp):
    return train_args(p, tmp / "run", fixture(p, "corpus"), **{"model.layernorm_epsilon": "-1e-5"})


@case("training", "adam_eps_nan", "`optimizer.eps=.nan`")
def _(p, tmp):
    return train_args(p, tmp / "run", fixture(p, "corpus"), **{"optimizer.eps": ".nan"})


@case("training", "nested_yaml_override", "`deepspeed.x=` a value nested 20,000 lists deep")
def _(p, tmp):
    return train_args(p, tmp / "run", fixture(p, "corpus"), **{"deepspeed.x": "[" * 20000 + "]" * 20000})


def _lock_released(p, tmp, res):
    said = [x for x in res.out.splitlines() if x.startswith("interrupted:")]
    if len(said) != 1:
        return f"{len(said)} 'interrupted:' lines"
    lock = tmp / "run" / ".lock"
    return None if not lock.exists() or lock.read_text() == "" else "a rank was killed before it released the run's lock"


@case("training", "ctrl_c_group_deepspeed", "Ctrl-C to the process group of a TP=2 run under the deepspeed launcher",
      timeout=300, check=_lock_released, interrupt="run/checkpoints/latest", settle=1.0,
      foreign=deepspeed_runner_traceback)
def _(p, tmp):
    args = train_args(p, tmp / "run", fixture(p, "corpus"), 100000, **{"parallel.tensor": "2"})
    return ["deepspeed", "--num_gpus", "2", "--master_port", str(_free_port()), "--module", *args[2:]]


# ---- evaluation ----------------------------------------------------------------------------------
def _words(tmp: Path) -> Path:
    f = tmp / "w.tokens"
    f.write_text(" = Title = \n the cat sat on the mat and the dog sat on the log . \n" * 4, encoding="utf-8")
    return f


def _wikitext(run: Path, data: Path, *extra: str) -> list[str]:
    return ["python", "-m", "evaluation", "wikitext103", "--checkpoint", str(run), "--data", str(data),
            "--no-progress", "--json", str(data.parent / "r.json"), *extra]


@case("evaluation", "wikitext_ok", "WikiText perplexity of the tiny run (control)", "ok")
def _(p, tmp):
    return _wikitext(fixture(p, "run"), _words(tmp))


@case("evaluation", "checkpoint_missing", "`--checkpoint` names nothing")
def _(p, tmp):
    return _wikitext(tmp / "none", _words(tmp))


@case("evaluation", "checkpoint_is_corpus", "a corpus folder passed as `--checkpoint`")
def _(p, tmp):
    return _wikitext(fixture(p, "corpus"), _words(tmp))


@case("evaluation", "checkpoint_binary_latest", "a binary checkpoints/latest")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    (run / "checkpoints" / "latest").write_bytes(b"\x80\x81\xfe\x00")
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_missing_tp_shard", "a TP=2 checkpoint with mp_rank_01 deleted")
def _(p, tmp):
    run = copy_of(p, "run_tp2", tmp / "run")
    next((run / "checkpoints").glob("*/mp_rank_01_model_states.pt")).unlink()
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_truncated", "the model file cut short")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    f = latest_tag_dir(run) / "mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:4096])
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_zero_byte", "the model file emptied (0 bytes)")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    (latest_tag_dir(run) / "mp_rank_00_model_states.pt").write_bytes(b"")
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_latest_deleted", "checkpoints/latest lost: the line must name the tag to pass")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    (run / "checkpoints" / "latest").unlink()
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_malicious_pickle", "a model file whose pickle runs code", check=pwned)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    _plant_evil(p, latest_tag_dir(run) / "mp_rank_00_model_states.pt", tmp / "PWNED")
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_symlinked_tag", "the latest tag folder is a symlink")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    tag = latest_tag_dir(run)
    shutil.move(str(tag), tmp / "moved")
    tag.symlink_to(tmp / "moved")
    return _wikitext(run, _words(tmp))


@case("evaluation", "checkpoint_tokenizer_swapped", "the run's tokenizer files edited after training (same size)")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    swap_merges(run / "tokenizer")
    return _wikitext(run, _words(tmp))


@case("evaluation", "wikitext_empty", "an empty WikiText file")
def _(p, tmp):
    (tmp / "e.tokens").write_text("")
    return _wikitext(fixture(p, "run"), tmp / "e.tokens")


@case("evaluation", "wikitext_one_word", "a WikiText file of one word")
def _(p, tmp):
    (tmp / "e.tokens").write_text(" hello \n")
    return _wikitext(fixture(p, "run"), tmp / "e.tokens")


@case("evaluation", "wikitext_binary", "a binary WikiText file")
def _(p, tmp):
    (tmp / "b.tokens").write_bytes(BINARY)
    return _wikitext(fixture(p, "run"), tmp / "b.tokens")


@case("evaluation", "wikitext_missing", "`--data` names nothing")
def _(p, tmp):
    return _wikitext(fixture(p, "run"), tmp / "none.tokens")


@case("evaluation", "wikitext_tp_too_large", "`--tp 2` in a single process")
def _(p, tmp):
    return _wikitext(fixture(p, "run"), _words(tmp), "--tp", "2")


@case("evaluation", "wikitext_seq_too_long", "`--seq-length 4096` beyond the model's positions")
def _(p, tmp):
    return _wikitext(fixture(p, "run"), _words(tmp), "--seq-length", "4096")


@case("evaluation", "hf_dataset_loading_script", "`--hf-dataset` naming a loading script",
      check=lambda p, tmp, res: "the loading script ran" if (tmp / "PWNED").exists() else None)
def _(p, tmp):
    (tmp / "ds").mkdir()
    (tmp / "ds" / "ds.py").write_text(f"open({str(tmp / 'PWNED')!r}, 'w').write('x')\n")
    return ["python", "-m", "evaluation", "wikitext103", "--checkpoint", str(fixture(p, "run")), "--hf-dataset",
            str(tmp / "ds"), "--no-progress", "--json", str(tmp / "r.json")]


def _lambada(run: Path, data: Path) -> list[str]:
    return ["python", "-m", "evaluation", "lambada", "--checkpoint", str(run), "--data", str(data), "--no-progress",
            "--json", str(data.parent / "r.json")]


@case("evaluation", "lambada_binary", "a binary LAMBADA file")
def _(p, tmp):
    (tmp / "l.jsonl").write_bytes(BINARY)
    return _lambada(fixture(p, "run"), tmp / "l.jsonl")


@case("evaluation", "lambada_bad_lines", "LAMBADA lines without `text`, cut JSON, nested 1,000 deep", "either")
def _(p, tmp):
    good = json.dumps({"text": "the cat sat on the mat and looked at the dog"})
    (tmp / "l.jsonl").write_text("\n".join([good, '{"nope": 1}', '{"text": "cut', "[" * 1000 + "]" * 1000,
                                            good]) + "\n")
    return _lambada(fixture(p, "run"), tmp / "l.jsonl")


@case("evaluation", "lambada_nested_line", "a LAMBADA line nested 1,000 deep")
def _(p, tmp):
    good = json.dumps({"text": "the cat sat on the mat and looked at the dog"})
    (tmp / "l.jsonl").write_text("\n".join([good, "[" * 1000 + "]" * 1000, good]) + "\n")
    return _lambada(fixture(p, "run"), tmp / "l.jsonl")


@case("evaluation", "lambada_huge_number", "a LAMBADA line holding a 100,000-digit number")
def _(p, tmp):
    good = json.dumps({"text": "the cat sat on the mat and looked at the dog"})
    (tmp / "l.jsonl").write_text("\n".join([good, '{"text": "a b", "n": ' + "9" * 100000 + "}", good]) + "\n")
    return _lambada(fixture(p, "run"), tmp / "l.jsonl")


@case("evaluation", "wikitext_batch_size_zero", "`--batch-size 0`")
def _(p, tmp):
    return _wikitext(fixture(p, "run"), _words(tmp), "--batch-size", "0")


@case("evaluation", "wikitext_limit_negative", "`--limit -1`")
def _(p, tmp):
    return _wikitext(fixture(p, "run"), _words(tmp), "--limit", "-1")


@case("evaluation", "generate_prompts_nested_jsonl", "a `--prompts` .jsonl line nested 1,000 deep")
def _(p, tmp):
    (tmp / "p.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n" + "[" * 1000 + "]" * 1000 + "\n")
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompts",
            str(tmp / "p.jsonl"), "--max-new-tokens", "2", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "lambada_bom", "a LAMBADA file starting with a UTF-8 BOM", "ok",
      check=lambda p, tmp, res: None if '"count": 2' in (tmp / "r.json").read_text() or
      '"n": 2' in (tmp / "r.json").read_text() or '2' in (tmp / "r.json").read_text() else "a record was lost")
def _(p, tmp):
    good = json.dumps({"text": "the cat sat on the mat and looked at the dog"})
    (tmp / "l.jsonl").write_bytes(b"\xef\xbb\xbf" + (good + "\n" + good + "\n").encode())
    return _lambada(fixture(p, "run"), tmp / "l.jsonl")


@case("evaluation", "generate_binary_prompts", "a binary `--prompts` file")
def _(p, tmp):
    (tmp / "p.txt").write_bytes(BINARY)
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompts",
            str(tmp / "p.txt"), "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "generate_negative_tokens", "`generate --max-new-tokens -1`")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompt", "hello",
            "--max-new-tokens", "-1", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "generate_top_p_range", "`generate --top-p 5`")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompt", "hello",
            "--top-p", "5", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "generate_tp2_launcher", "`generate --tp 2` under the launcher (teardown at exit)", "ok",
      timeout=300, check=lambda p, tmp, res: None if (tmp / "r.json").is_file() else "no output written")
def _(p, tmp):
    return ["deepspeed", "--num_gpus", "2", "--master_port", str(_free_port()), "--module", "evaluation", "generate",
            "--checkpoint", str(fixture(p, "run_tp2")), "--tp", "2", "--prompt", "hello world",
            "--max-new-tokens", "4", "--greedy", "--no-progress", "--json", str(tmp / "r.json")]


def _one_error_line(p, tmp, res):
    n = sum(bool(re.match(r"^(\[rank\d+\]: )?(checkpoint )?error: ", line)) for line in res.out.splitlines())
    return None if n == 1 else f"{n} error lines (one per rank?)"


@case("evaluation", "tp2_launcher_truncated_shard", "`wikitext103 --tp 2` under the launcher, rank 1's shard cut short",
      timeout=300, check=_one_error_line)
def _(p, tmp):
    run = copy_of(p, "run_tp2", tmp / "run")
    f = next((run / "checkpoints").glob("*/mp_rank_01_model_states.pt"))
    f.write_bytes(f.read_bytes()[:4096])
    return ["deepspeed", "--num_gpus", "2", "--master_port", str(_free_port()), "--module", "evaluation", "wikitext103",
            "--checkpoint", str(run), "--tp", "2", "--data", str(_words(tmp)), "--no-progress", "--json",
            str(tmp / "r.json")]


@case("evaluation", "heldout_without_corpus", "`heldout --corpus` names nothing")
def _(p, tmp):
    return ["python", "-m", "evaluation", "heldout", "--checkpoint", str(fixture(p, "run")), "--corpus",
            str(tmp / "none"), "--split", "949,50,1", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "race_on_gpt", "`race` on a GPT-2 checkpoint")
def _(p, tmp):
    for level in ("middle", "high"):
        race = tmp / "RACE" / "dev" / level
        race.mkdir(parents=True)
        (race / "1.txt").write_text(json.dumps({"article": "a b c", "questions": ["q?"],
                                                "options": [["a", "b", "c", "d"]], "answers": ["A"], "id": "1.txt"}))
    return ["python", "-m", "evaluation", "race", "--checkpoint", str(fixture(p, "run")), "--data",
            str(tmp / "RACE"), "--split", "dev", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "race_folder_missing", "`race --data` names nothing")
def _(p, tmp):
    return ["python", "-m", "evaluation", "race", "--checkpoint", str(fixture(p, "run")), "--data",
            str(tmp / "none"), "--split", "dev", "--no-progress", "--json", str(tmp / "r.json")]


RACE_READ = textwrap.dedent("""
    import sys
    from megatron_ds_suite.core.race import read_race_dir
    res = read_race_dir(sys.argv[1])
    qs = res[0] if isinstance(res, tuple) else res
    print("questions", len(qs))
""")


@case("evaluation", "race_empty_file", "an empty RACE article file among good ones (read_race_dir)", "ok",
      check=lambda p, tmp, res: None if re.search(r"skipped [1-9]", res.out) else "the empty file was not reported")
def _(p, tmp):
    race = tmp / "RACE" / "dev" / "middle"
    race.mkdir(parents=True)
    (race / "1.txt").write_text(json.dumps({"article": "a b c", "questions": ["q?"], "options": [["a", "b", "c", "d"]],
                                            "answers": ["A"], "id": "1.txt"}))
    (race / "2.txt").write_text("")
    return ["python", "-c", RACE_READ, str(race)]


def _race_dir(tmp: Path, bad: str) -> Path:
    race = tmp / "RACE" / "dev" / "middle"
    race.mkdir(parents=True)
    (race / "1.txt").write_text(json.dumps({"article": "a b c", "questions": ["q?"], "options": [["a", "b", "c", "d"]],
                                            "answers": ["A"], "id": "1.txt"}))
    (race / "2.txt").write_text(bad)
    return race


@case("evaluation", "race_nested_file", "a RACE file nested 1,000 deep (read_race_dir)", "ok",
      check=lambda p, tmp, res: None if re.search(r"skipped [1-9]", res.out) else "the bad file was not reported")
def _(p, tmp):
    return ["python", "-c", RACE_READ, str(_race_dir(tmp, "[" * 1000 + "]" * 1000))]


@case("evaluation", "race_huge_number", "a RACE file holding a 100,000-digit number (read_race_dir)", "ok",
      check=lambda p, tmp, res: None if re.search(r"skipped [1-9]", res.out) else "the bad file was not reported")
def _(p, tmp):
    return ["python", "-c", RACE_READ, str(_race_dir(tmp, '{"article": ' + "9" * 100000 + "}"))]


@case("evaluation", "generate_prompt_not_utf8", "`generate --prompt $'\\xff'` (argument bytes that are not UTF-8)")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompt", "\udcff",
            "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "generate_prompt_cut_utf8", "`generate --prompt` ending in a cut UTF-8 sequence (`caf\\xc3`)")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompt", "caf\udcc3",
            "--no-progress", "--json", str(tmp / "r.json")]


NAN_WEIGHTS = textwrap.dedent("""
    import sys, torch
    f = sys.argv[1]
    sd = torch.load(f, map_location="cpu", weights_only=False)
    module = sd["module"]
    key = next(k for k in module if k.endswith("word_embeddings.weight"))
    module[key][:, 0] = float(sys.argv[2])
    torch.save(sd, f)
""")


def _poisoned_run(p, tmp, value: str) -> Path:
    run = copy_of(p, "run", tmp / "run")
    res = p.run(["python", "-c", NAN_WEIGHTS, str(latest_tag_dir(run) / "mp_rank_00_model_states.pt"), value],
                timeout=120)
    if res.rc != 0:
        raise RuntimeError(res.out[-2000:])
    return run


@case("evaluation", "generate_nan_weights", "`generate` (sampling) on a checkpoint with NaN embedding weights")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(_poisoned_run(p, tmp, "nan")), "--prompt",
            "hello", "--max-new-tokens", "3", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "generate_inf_weights_greedy", "`generate --greedy` on a checkpoint with infinite weights")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(_poisoned_run(p, tmp, "inf")), "--prompt",
            "hello", "--max-new-tokens", "3", "--greedy", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "generate_tiny_temperature", "`generate --temperature 1e-45` (logits / T overflow)")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompt", "hello",
            "--temperature", "1e-45", "--max-new-tokens", "3", "--no-progress", "--json", str(tmp / "r.json")]


@case("evaluation", "json_parent_is_file", "`wikitext103 --json FILE/r.json` (found only after scoring)")
def _(p, tmp):
    (tmp / "f").write_text("x")
    return _wikitext(fixture(p, "run"), _words(tmp))[:-2] + ["--json", str(tmp / "f" / "r.json")]


@case("evaluation", "json_is_folder", "`generate --json` an existing folder")
def _(p, tmp):
    return ["python", "-m", "evaluation", "generate", "--checkpoint", str(fixture(p, "run")), "--prompt", "hello",
            "--max-new-tokens", "2", "--no-progress", "--json", str(tmp)]


@case("evaluation", "lm_eval_hub_task_offline", "`lm-eval --tasks lambada_openai` offline (HF_HUB_OFFLINE=1)")
def _(p, tmp):
    return ["python", "-m", "evaluation", "lm-eval", "--checkpoint", str(fixture(p, "run")), "--tasks", "lambada_openai",
            "--limit", "2", "--json", str(tmp / "r.json")]


@case("evaluation", "lm_eval_wikitext_binary", "`lm-eval --wikitext` a binary file")
def _(p, tmp):
    (tmp / "w.tokens").write_bytes(BINARY)
    return ["python", "-m", "evaluation", "lm-eval", "--checkpoint", str(fixture(p, "run")), "--tasks", "wikitext_local",
            "--wikitext", str(tmp / "w.tokens"), "--json", str(tmp / "r.json")]


@case("evaluation", "lm_eval_lambada_not_json", "`lm-eval --lambada` a file whose second line is not JSON")
def _(p, tmp):
    (tmp / "l.jsonl").write_text('{"text": "a b c d"}\nnot json\n')
    return ["python", "-m", "evaluation", "lm-eval", "--checkpoint", str(fixture(p, "run")), "--tasks",
            "lambada_openai_local", "--lambada", str(tmp / "l.jsonl"), "--json", str(tmp / "r.json")]


@case("evaluation", "lm_eval_json_parent_is_file", "`lm-eval --json FILE/r.json` (results lost after scoring)")
def _(p, tmp):
    (tmp / "f").write_text("x")
    (tmp / "w.tokens").write_text(" = T = \n the quick brown fox jumps over the lazy dog \n")
    return ["python", "-m", "evaluation", "lm-eval", "--checkpoint", str(fixture(p, "run")), "--tasks", "wikitext_local",
            "--wikitext", str(tmp / "w.tokens"), "--json", str(tmp / "f" / "r.json")]


# ---- tools -----------------------------------------------------------------------------------------
def _export(ckpt: Path, out: Path, *extra: str) -> list[str]:
    return ["python", "-m", "training.tools.export_hf", "--checkpoint", str(ckpt), "--out", str(out), *extra]


def _run_intact(p, tmp, res):
    run = tmp / "run"
    if not (run / "checkpoints").is_dir():
        return "the run was deleted"
    return "the run was modified" if _snap_changed(tmp) else None


@case("tools", "export_ok", "export the tiny run (control)", "ok")
def _(p, tmp):
    return _export(fixture(p, "run"), tmp / "hf")


@case("tools", "export_onto_itself", "`export_hf --checkpoint R --out R --overwrite`", check=_run_intact)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    _snap_save(tmp)
    return _export(run, run, "--overwrite")


@case("tools", "export_onto_parent", "`export_hf --out` the folder holding the run, `--overwrite`",
      check=_run_intact)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    _snap_save(tmp)
    return _export(run, tmp, "--overwrite")


@case("tools", "export_into_run", "`export_hf --out RUN/hf` inside the run")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    return _export(run, run / "hf")


@case("tools", "export_onto_live_run", "`export_hf --out LIVE --overwrite` onto a run a training process holds",
      check=_run_intact)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    _snap_save(tmp)
    p.hold(tmp, run)
    return _export(fixture(p, "run"), run, "--overwrite")


@case("tools", "export_out_exists", "`export_hf --out` an existing non-empty folder without --overwrite",
      check=lambda p, tmp, res: None if (tmp / "hf" / "keep.txt").is_file() else "the folder was replaced")
def _(p, tmp):
    (tmp / "hf").mkdir()
    (tmp / "hf" / "keep.txt").write_text("mine")
    return _export(fixture(p, "run"), tmp / "hf")


@case("tools", "export_missing_tp_shard", "export a TP=2 checkpoint with a shard deleted")
def _(p, tmp):
    run = copy_of(p, "run_tp2", tmp / "run")
    next((run / "checkpoints").glob("*/mp_rank_01_model_states.pt")).unlink()
    return _export(run, tmp / "hf")


@case("tools", "export_binary_latest", "export a run with a binary latest")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    (run / "checkpoints" / "latest").write_bytes(b"\x80\x81\xfe\x00")
    return _export(run, tmp / "hf")


@case("tools", "export_corpus_folder", "a corpus folder as `export_hf --checkpoint`")
def _(p, tmp):
    return _export(fixture(p, "corpus"), tmp / "hf")


@case("tools", "export_checkpoint_is_file", "`export_hf --checkpoint` a file")
def _(p, tmp):
    return _export(fixture(p, "text"), tmp / "hf")


@case("tools", "export_symlinked_tag", "export a run whose tag folder is a symlink")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    tag = latest_tag_dir(run)
    shutil.move(str(tag), tmp / "moved")
    tag.symlink_to(tmp / "moved")
    return _export(run, tmp / "hf")


@case("tools", "export_zero_byte_shard", "the model file emptied (0 bytes)")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    (latest_tag_dir(run) / "mp_rank_00_model_states.pt").write_bytes(b"")
    return _export(run, tmp / "hf")


@case("tools", "export_malicious_pickle", "export a model file whose pickle runs code", check=pwned)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    _plant_evil(p, latest_tag_dir(run) / "mp_rank_00_model_states.pt", tmp / "PWNED")
    return _export(run, tmp / "hf")


def _import(model: Path, out: Path, *extra: str) -> list[str]:
    return ["python", "-m", "training.tools.import_hf", "--model", str(model), "--out", str(out), *extra]


@case("tools", "import_ok", "import the random GPT-2 at TP=1 (control)", "ok")
def _(p, tmp):
    return _import(fixture(p, "hf"), tmp / "run")


@case("tools", "import_damaged_weights", "`import_hf` of a model.safetensors cut short",
      check=lambda p, tmp, res: "a run was written" if (tmp / "run").exists() else None)
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    w = src / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    return _import(src, tmp / "run")


@case("tools", "import_garbage_weights", "`import_hf` of a model.safetensors full of junk")
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    (src / "model.safetensors").write_bytes(BINARY * 16)
    return _import(src, tmp / "run")


@case("tools", "import_binary_config", "`import_hf` of a folder whose config.json is binary")
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    (src / "config.json").write_bytes(BINARY)
    return _import(src, tmp / "run")


@case("tools", "import_offline_hub_name", "`import_hf --model` an unknown hub name, offline")
def _(p, tmp):
    return _import(Path("no-such-org/no-such-model"), tmp / "run")


@case("tools", "import_onto_live_run", "`import_hf --out LIVE --overwrite` onto a run a training process holds",
      check=_run_intact)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    _snap_save(tmp)
    p.hold(tmp, run)
    return _import(fixture(p, "hf"), run, "--overwrite")


@case("tools", "import_onto_its_model", "`import_hf --out` the model folder itself, `--overwrite`",
      check=lambda p, tmp, res: None if (tmp / "hf" / "model.safetensors").is_file() else "the model was deleted")
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    return _import(src, src, "--overwrite")


@case("tools", "import_tp_not_dividing", "`import_hf --tp 3` (2 heads)")
def _(p, tmp):
    return _import(fixture(p, "hf"), tmp / "run", "--tp", "3")


def _hf_weights(src: Path, fn) -> None:
    """Edit the random GPT-2's model.safetensors in place (``fn`` gets its {name: tensor})."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(src / "model.safetensors"))
    fn(sd)
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})


def _hf_config(src: Path, **values) -> None:
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **values}))


def _nothing_written(p, tmp, res):
    return "a run was written" if (tmp / "run").exists() else None


@case("tools", "import_missing_tensor", "`import_hf` of a model.safetensors lacking one tensor (random-filled before)",
      check=_nothing_written)
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    _hf_weights(src, lambda sd: sd.pop("transformer.h.0.mlp.c_fc.weight"))
    return _import(src, tmp / "run")


@case("tools", "import_config_more_layers", "`import_hf` of a config.json claiming 3 layers, weights of 1",
      check=_nothing_written)
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    _hf_config(src, n_layer=3)
    return _import(src, tmp / "run")


@case("tools", "import_partial_shard_index", "`import_hf` of shards whose model.safetensors.index.json omits tensors",
      check=_nothing_written)
def _(p, tmp):
    from safetensors.torch import load_file, save_file

    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    sd = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    names, wmap = sorted(sd), {}
    for k in range(2):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: sd[n] for n in names[k::2]}, str(src / fname), metadata={"format": "pt"})
        wmap.update({n: fname for n in names[k::2]})
    omitted = {n for n in names if ".mlp." in n}
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.numel() * 4 for t in sd.values())},
         "weight_map": {n: f for n, f in wmap.items() if n not in omitted}}))
    return _import(src, tmp / "run")


@case("tools", "import_unexpected_tensor", "`import_hf` of weights holding a tensor the model lacks",
      check=_nothing_written)
def _(p, tmp):
    import torch

    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    _hf_weights(src, lambda sd: sd.__setitem__("transformer.h.4.attn.c_attn.weight", torch.zeros(32, 96)))
    return _import(src, tmp / "run")


@case("tools", "import_shape_mismatch", "`import_hf` of a LayerNorm weight of 33 values in a hidden-32 model",
      check=_nothing_written)
def _(p, tmp):
    import torch

    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    _hf_weights(src, lambda sd: sd.__setitem__("transformer.h.0.ln_1.weight", torch.ones(33)))
    return _import(src, tmp / "run")


@case("tools", "import_nan_weight", "`import_hf` of weights holding a NaN", check=_nothing_written)
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    _hf_weights(src, lambda sd: sd["transformer.h.0.attn.c_proj.weight"].view(-1).__setitem__(7, float("nan")))
    return _import(src, tmp / "run")


@case("tools", "import_config_bad_value", "`import_hf` of a config.json with `n_layer: \"three\"`",
      check=_nothing_written)
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    _hf_config(src, n_layer="three")
    return _import(src, tmp / "run")


@case("tools", "import_tokenizer_swapped", "export an imported run whose merges.txt was edited after the import")
def _(p, tmp):
    run = copy_of(p, "run_tp2", tmp / "run")
    f = run / "tokenizer" / "merges.txt"
    lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[10], lines[11] = lines[11], lines[10]
    f.write_text("".join(lines), encoding="utf-8")
    return _export(run, tmp / "hf")


def _megatron(src: Path, out: Path) -> list[str]:
    return ["python", "-m", "training.tools.import_megatron", "--checkpoint", str(src), "--out", str(out),
            "--vocab-file", str(GPT2_TOK / "gpt2-vocab.json"), "--merge-file", str(GPT2_TOK / "gpt2-merges.txt")]


def _megatron_copy(p: Probe, tmp: Path) -> Path:
    """A private copy of a tiny Megatron-LM GPT-2 saved at TP=2 (legacy layout). Written by this probe's own
    checkout (megatron_ds_suite/app/megatron_files.py): the files are Megatron's format, not the checkout's."""
    with p.lock:
        if "megatron" not in p.fixtures:
            from megatron_ds_suite.app.megatron_files import write_megatron_gpt2

            write_megatron_gpt2(p.base / "fixtures" / "megatron", tp=2)
            p.fixtures["megatron"] = p.base / "fixtures" / "megatron"
    return Path(shutil.copytree(p.fixtures["megatron"], tmp / "meg"))


def _megatron_edit(src: Path, fn, ranks=("mp_rank_00", "mp_rank_01")) -> None:
    import torch

    for r in ranks:
        f = src / "iter_0000007" / r / "model_optim_rng.pt"
        state = torch.load(f, weights_only=False)
        fn(state)
        torch.save(state, f)


def _names_missing_rank(p, tmp, res):
    return None if "mp_rank_01/model_optim_rng.pt" in res.out else "the error does not name the missing rank file"


@case("tools", "import_megatron_ok", "import a tiny TP=2 Megatron-LM GPT-2 (control)", "ok")
def _(p, tmp):
    return _megatron(_megatron_copy(p, tmp), tmp / "run")


@case("tools", "import_megatron_shared_dicts", "a 1 KB model_optim_rng.pt whose dicts hold the next one twice, 40 deep",
      timeout=60)
def _(p, tmp):
    from megatron_ds_suite.app.megatron_files import shared_dicts

    src = _megatron_copy(p, tmp)
    _megatron_edit(src, lambda s: s.__setitem__("model", shared_dicts(40, 0.0)))
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_deep_nesting", "a model state nested 5,000 dicts deep")
def _(p, tmp):
    import torch

    from megatron_ds_suite.app.megatron_files import nested_dicts, torch_save_deep

    src = _megatron_copy(p, tmp)
    for r in ("mp_rank_00", "mp_rank_01"):
        f = src / "iter_0000007" / r / "model_optim_rng.pt"
        state = torch.load(f, weights_only=False)
        state["model"]["language_model"]["encoder"]["junk"] = nested_dicts(5000, 0.0)
        torch_save_deep(state, f)
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_cyclic", "a model state dict that holds itself")
def _(p, tmp):
    def damage(state):
        enc = state["model"]["language_model"]["encoder"]
        enc["loop"] = enc

    src = _megatron_copy(p, tmp)
    _megatron_edit(src, damage)
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_rank_iteration", "rank files of two iterations (mp_rank_01 of iteration 8)",
      check=_nothing_written)
def _(p, tmp):
    src = _megatron_copy(p, tmp)
    _megatron_edit(src, lambda s: s.__setitem__("iteration", 8), ranks=("mp_rank_01",))
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_rank_args", "rank files saved with other args (mp_rank_01: hidden_dropout 0.2)",
      check=_nothing_written)
def _(p, tmp):
    src = _megatron_copy(p, tmp)
    _megatron_edit(src, lambda s: setattr(s["args"], "hidden_dropout", 0.2), ranks=("mp_rank_01",))
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_rank_shapes", "mp_rank_01's QKV shard of another shape")
def _(p, tmp):
    import torch

    src = _megatron_copy(p, tmp)
    _megatron_edit(src, lambda s: s["model"]["language_model"]["encoder"].__setitem__(
        "layers.0.self_attention.query_key_value.weight", torch.zeros(30, 16)), ranks=("mp_rank_01",))
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_missing_tp_rank", "a TP=2 checkpoint with mp_rank_01 deleted",
      check=_names_missing_rank)
def _(p, tmp):
    src = _megatron_copy(p, tmp)
    shutil.rmtree(src / "iter_0000007" / "mp_rank_01")
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_rank_count", "a third rank file beside a checkpoint whose args say TP=2",
      check=lambda p, tmp, res: None if "TP=2" in res.out else "the error does not name the checkpoint's TP")
def _(p, tmp):
    src = _megatron_copy(p, tmp)
    shutil.copytree(src / "iter_0000007" / "mp_rank_01", src / "iter_0000007" / "mp_rank_02")
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_replicated_differ", "a LayerNorm weight that differs between the two TP ranks",
      check=_nothing_written)
def _(p, tmp):
    def damage(state):
        enc = state["model"]["language_model"]["encoder"]
        enc["layers.0.input_layernorm.weight"] = enc["layers.0.input_layernorm.weight"] + 0.01

    src = _megatron_copy(p, tmp)
    _megatron_edit(src, damage, ranks=("mp_rank_01",))
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_string_args", "args with `num_attention_heads: \"4\"` (a string)")
def _(p, tmp):
    src = _megatron_copy(p, tmp)
    _megatron_edit(src, lambda s: setattr(s["args"], "num_attention_heads", "4"))
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_nan", "a NaN in the MLP weight of both TP ranks", check=_nothing_written)
def _(p, tmp):
    src = _megatron_copy(p, tmp)
    _megatron_edit(src, lambda s: s["model"]["language_model"]["encoder"][
        "layers.1.mlp.dense_h_to_4h.weight"].view(-1).__setitem__(3, float("nan")))
    return _megatron(src, tmp / "run")


def _reshard(ckpt: Path, out: Path, *extra: str) -> list[str]:
    return ["python", "-m", "training.tools.reshard", "--checkpoint", str(ckpt), "--out", str(out), *extra]


@case("tools", "reshard_into_itself", "`reshard --out` the run it reads", check=_run_intact)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    _snap_save(tmp)
    return _reshard(run, run, "--tp", "1")


@case("tools", "reshard_tp_zero", "`reshard --tp 0`")
def _(p, tmp):
    return _reshard(fixture(p, "run"), tmp / "out", "--tp", "0")


@case("tools", "reshard_missing_shard", "reshard a TP=2 checkpoint with a shard deleted")
def _(p, tmp):
    run = copy_of(p, "run_tp2", tmp / "run")
    next((run / "checkpoints").glob("*/mp_rank_01_model_states.pt")).unlink()
    return _reshard(run, tmp / "out", "--tp", "1")


@case("tools", "reshard_tag_missing", "`reshard --tag` a tag that is not there")
def _(p, tmp):
    return _reshard(fixture(p, "run"), tmp / "out", "--tp", "1", "--tag", "iter_0000099")


@case("tools", "reshard_tag_escapes", "`reshard --tag ../../x`")
def _(p, tmp):
    return _reshard(fixture(p, "run"), tmp / "out", "--tp", "1", "--tag", "../../x")


@case("tools", "reshard_corpus_folder", "a corpus folder as `reshard --checkpoint`")
def _(p, tmp):
    return _reshard(fixture(p, "corpus"), tmp / "out", "--tp", "1")


@case("tools", "reshard_symlinked_tag", "reshard a run whose tag folder is a symlink")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    tag = latest_tag_dir(run)
    shutil.move(str(tag), tmp / "moved")
    tag.symlink_to(tmp / "moved")
    return _reshard(run, tmp / "out", "--tp", "1")


CONFIGS = "from megatron_ds_suite.app.console import configs; configs()"


@case("tools", "configs_copy_onto_edited", "`megatron-ds-configs copy` onto an existing (edited) file",
      check=lambda p, tmp, res: None if (tmp / "mine.yaml").read_text() == "# my edits\n" else
      "the edited file was replaced")
def _(p, tmp):
    (tmp / "mine.yaml").write_text("# my edits\n")
    return ["python", "-c", CONFIGS, "copy", "gpt2_tiny.yaml", str(tmp / "mine.yaml")]


@case("tools", "configs_copy_missing_folder", "`megatron-ds-configs copy NAME DIR/MISSING/x.yaml`")
def _(p, tmp):
    return ["python", "-c", CONFIGS, "copy", "gpt2_tiny.yaml", str(tmp / "missing" / "x.yaml")]


@case("tools", "configs_copy_unknown", "`megatron-ds-configs copy` an unknown config name")
def _(p, tmp):
    return ["python", "-c", CONFIGS, "copy", "nosuch.yaml", str(tmp / "x.yaml")]


@case("tools", "plan_bad_config", "`python -m training.plan` on a binary config")
def _(p, tmp):
    (tmp / "c.yaml").write_bytes(BINARY)
    return ["python", "-m", "training.plan", "--config", str(tmp / "c.yaml")]


@case("tools", "main_job_unknown_override", "`main_job` with an unknown override")
def _(p, tmp):
    return ["python", "-m", "megatron_ds_suite.main_job", "--config", p.configs("main/ci.yaml"), "nosuch.key=1"]


# --------------------------------------------------------------------------------------------------
# Classification and reports
# --------------------------------------------------------------------------------------------------
TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
LOG_LINE = re.compile(r"^\s*(\[\d{4}-\d\d-\d\d|\d{4}-\d\d-\d\d[ T]\d\d:|\d\d/\d\d \d\d:|[A-Z]+:[\w.]+:|W\d{4}|I\d{4}|"
                      r"\[rank\d+\]:\[W|warnings\.warn|.*Warning: |wandb: )")


def error_lines(out: str) -> list[str]:
    """Lines a user reads as the message: not log records, not progress, not blank."""
    keep = []
    for line in out.splitlines():
        s = line.strip()
        if not s or LOG_LINE.match(line) or " INFO " in line or " WARNING " in line or s.startswith("warning:"):
            continue
        keep.append(s)
    return keep


def classify(c: Case, res: Result, problem: str | None) -> tuple[str, str]:
    """(outcome, note)."""
    lines = error_lines(res.out)
    last = lines[-1] if lines else ""
    if res.rc is None:
        return "hang", f"killed after {res.seconds:.0f}s"
    if TRACEBACK.search(res.out):
        tb = [x for x in res.out.splitlines() if re.match(r"^\w*(Error|Exception|Interrupt)\b", x.strip())]
        return "traceback", (tb[-1] if tb else last)[:200]
    if problem:
        return "silent", problem
    if res.rc == 0:
        return ("silent", "exit 0 on a wrong input") if c.expect == "error" else ("clean", "exit 0")
    if c.expect == "ok":
        return "clean", f"refused where it should go on (exit {res.rc}): {last[:160]}"
    return "clean", f"exit {res.rc}: {last[:200]}"


def run_case(p: Probe, c: Case) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"{c.name}-", dir=p.base))
    t0 = time.monotonic()
    try:
        cmd = c.setup(p, tmp)
    except Exception as e:  # noqa: BLE001 - a case that cannot be set up on this checkout is reported, not fatal
        return {"area": c.area, "name": c.name, "defect": c.defect, "expect": c.expect, "outcome": "setup failed",
                "note": f"{type(e).__name__}: {str(e)[-300:]}", "rc": None, "seconds": 0.0}
    env = p.extra_env.pop(str(tmp), {})
    try:
        res = (p.interrupt(cmd, tmp / c.interrupt, timeout=c.timeout, settle=c.settle, **env) if c.interrupt
               else p.run(cmd, timeout=c.timeout, **env))
        if c.foreign is not None:
            res = Result(res.rc, c.foreign(res.out), res.seconds)
    finally:
        for h in p.holders.pop(str(tmp), []):
            h.close()
    problem = None
    try:
        if c.check is not None and not (res.rc not in (0, None) and c.expect == "ok"):
            problem = c.check(p, tmp, res)
    except Exception as e:  # noqa: BLE001
        problem = f"check failed: {type(e).__name__}: {e}"
    outcome, note = classify(c, res, problem)
    (p.base / "logs").mkdir(exist_ok=True)
    (p.base / "logs" / f"{c.area}.{c.name}.log").write_text(f"$ {' '.join(map(str, cmd))}\nrc={res.rc}\n{res.out}",
                                                           errors="surrogateescape")  # a non-UTF-8 argument
    return {"area": c.area, "name": c.name, "defect": c.defect, "expect": c.expect, "outcome": outcome,
            "note": note, "rc": res.rc, "seconds": round(time.monotonic() - t0, 1)}


def counts(rows: list[dict], area: str | None = None) -> dict[str, int]:
    sel = [r for r in rows if area is None or r["area"] == area]
    out = {k: sum(r["outcome"] == k for r in sel) for k in OUTCOMES}
    other = len(sel) - sum(out.values())
    if other:
        out["setup failed"] = other
    return out


def _md_counts(c: dict[str, int]) -> str:
    return " / ".join(str(c.get(k, 0)) for k in OUTCOMES) + (f" (+{c['setup failed']} not set up)"
                                                             if c.get("setup failed") else "")


def markdown(rows: list[dict], earlier: list[tuple[str, list[dict]]] | None = None, label: str = "result",
             changed_only: bool = False) -> str:
    """Per-area tables and the totals; with ``earlier`` (label, rows) runs: their outcomes in columns before
    this run's (``label``); ``changed_only``: list only the cases whose outcome differs between the runs."""
    earlier = earlier or []
    prev = [(name, {(r["area"], r["name"]): r for r in rs}) for name, rs in earlier]
    out = ["| counts (clean / traceback / silent / hang) | " + " | ".join([n for n, _ in earlier] + [label]) + " |",
           "|---|" + "---|" * (len(earlier) + 1)]
    for area in AREAS + (None,):
        cells = [_md_counts(counts(rs, area)) for _, rs in earlier] + [_md_counts(counts(rows, area))]
        out.append(f"| {area or '**total**'} | " + " | ".join(cells) + " |")
    for area in AREAS:
        sel = [r for r in rows if r["area"] == area]
        if changed_only:
            sel = [r for r in sel if any(d.get((r["area"], r["name"]), {}).get("outcome") != r["outcome"]
                                         for _, d in prev)]
        if not sel:
            continue
        out += ["", f"### {area}", "",
                "| case | hostile input | " + " | ".join([n for n, _ in earlier] + [label]) + " | what the user sees"
                + (" now" if earlier else "") + " |", "|---|---|" + "---|" * (len(earlier) + 2)]
        for r in sel:
            note = re.sub(r"/tmp/hostile-probe-[^/ ]+/", "", r["note"]).replace("|", "\\|")
            before = [d.get((r["area"], r["name"]), {}).get("outcome", "-") for _, d in prev]
            out.append(f"| `{r['name']}` | {r['defect']} | " + " | ".join(before + [r["outcome"]]) + f" | {note} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--root", default=str(HERE), help="checkout whose commands are probed (default: this one)")
    ap.add_argument("--only", action="append", default=[],
                    help="glob over AREA.NAME (repeatable), e.g. 'training.*' or '*latest*'")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds before a command counts as a hang")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--md", help="write the markdown report here")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (logs/ has every command's output)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--changed", action="store_true", help="with --compare: only the cases whose outcome changed")
    ap.add_argument("--compare", nargs="+", metavar="LABEL=RUN.json",
                    help="report earlier runs side by side, oldest first (the last one's notes are shown)")
    args = ap.parse_args(argv)
    if args.compare:
        runs = [(x.split("=", 1)[0] if "=" in x else Path(x).stem,
                 json.loads(Path(x.split("=", 1)[-1]).read_text())["rows"]) for x in args.compare]
        text = markdown(runs[-1][1], runs[:-1], runs[-1][0], args.changed)
        if args.md:
            Path(args.md).write_text(text)
        print(text)
        return 0
    cases = [c for c in CASES if not args.only or any(fnmatch.fnmatch(f"{c.area}.{c.name}", pat) for pat in args.only)]
    if args.list:
        for c in cases:
            print(f"{c.area}.{c.name}: {c.defect} [{c.expect}]")
        return 0
    base = Path(tempfile.mkdtemp(prefix="hostile-probe-"))
    p = Probe(Path(args.root).resolve(), base, timeout=args.timeout)
    t0 = time.monotonic()
    rows: list[dict] = []
    try:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for row in pool.map(lambda c: run_case(p, c), cases):
                rows.append(row)
                print(f"[{time.monotonic() - t0:6.0f}s] {row['area']}.{row['name']}: {row['outcome']} "
                      f"({row['seconds']}s) {row['note'][:150]}", flush=True)
    finally:
        for hs in p.holders.values():
            for h in hs:
                h.close()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"scratch kept: {base}")
    total = counts(rows)
    print(f"\n{len(rows)} cases in {time.monotonic() - t0:.0f}s on {p.root}: " +
          ", ".join(f"{k} {v}" for k, v in total.items()))
    for line in p.fixture_log:
        print(line)
    text = markdown(rows)
    if args.md:
        Path(args.md).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"root": str(p.root), "seconds": round(time.monotonic() - t0),
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
