"""The probe's fixtures, built once per probe run by the checkout under test, then copied by the cases: a text file,
the GPT-2 tokenizer files, a tiny corpus, a two-step TP=1 GPT-2 run, a random transformers GPT-2 and its TP=2
import; the configs and commands that build them.
"""
from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path

from tests.hostile.outcome import error_lines
from tests.hostile.probe import Probe

HERE = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("SHARED_DATA", HERE.parent / "shared" / "data"))
if not SHARED.is_dir():
    SHARED = Path("/work/shared/data")
GPT2_TOK = SHARED / "tokenizers" / "gpt2"
SHAKESPEARE = SHARED / "corpus" / "tinyshakespeare.txt"
BINARY = bytes(range(256)) * 8  # not UTF-8: 0x80 cannot start a character


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
