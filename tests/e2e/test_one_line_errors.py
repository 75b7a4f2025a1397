"""Failures a user can cause are one line and a non-zero exit, not a traceback (issue 14, docs/errors.md)."""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.distributed import SHARED_DATA, free_port

ROOT = Path(__file__).resolve().parents[2]
BOTCHAN = Path(SHARED_DATA) / "corpus" / "botchan.txt"
SHAKESPEARE = Path(SHARED_DATA) / "corpus" / "tinyshakespeare.txt"
GPT2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"
needs_data = pytest.mark.skipif(not (BOTCHAN.is_file() and GPT2.is_dir()), reason="../shared/data absent")


def _one_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip() and " INFO " not in x and " WARNING " not in x]
    assert len(lines) == 1, text
    return lines[0]


def _config(tmp_path: Path, name: str, **extra) -> Path:
    text = tmp_path / "b.txt"
    if not text.exists():
        text.write_text(BOTCHAN.read_text(encoding="utf-8")[:30000], encoding="utf-8")
    cfg = {"output_dir": str(tmp_path / name), "workers": 1, "progress": False, "length": {"min_tokens": 8},
           "sources": [{"type": "text", "path": str(text), "text_mode": "blocks"}],
           "tokenizer": {"type": "gpt2", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
                         "merges_file": str(GPT2 / "gpt2-merges.txt")}}
    cfg.update(extra)
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@needs_data
def test_tokenizer_vocabulary_too_large(tmp_path, capsys):
    from data_pipeline.__main__ import main

    conf = _config(tmp_path, "big", tokenizer={"type": "sentencepiece", "vocab_size": 60000})
    assert main(["build", "--config", str(conf)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: SentencePiece training failed") and "Vocabulary size too high" in line


@needs_data
@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_missing_or_truncated_shard(tmp_path, capsys, damage):
    from data_pipeline.__main__ import main

    conf = _config(tmp_path, "out")
    assert main(["build", "--config", str(conf)]) == 0
    shard = tmp_path / "out" / "work" / "ingest" / "docs-00000.txt"  # the filter store reads its texts there
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:100])
    shutil.rmtree(next((tmp_path / "out" / "work").glob("signatures-*")))  # so dedup has to read the texts
    capsys.readouterr()
    assert main(["stage", "dedup", "--config", str(conf)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"docs-00000.txt is {damage}" in line and "build --force" in line


@needs_data
@pytest.mark.parametrize("holder", ["corpus build", "training run"])
def test_a_second_build_into_a_locked_output_folder_is_one_line(tmp_path, capsys, holder):
    """Another process holds the output folder (a build, or a training run, in the same folder): `build` and
    `stage` stop with one line before writing anything; once it is gone the build goes on."""
    from data_pipeline.__main__ import main

    conf = _config(tmp_path, "out")
    code = ("import sys, time\nfrom megatron_ds_suite.core.folder_lock import FolderLock\n"
            f"FolderLock({str(tmp_path / 'out')!r}, 'output_dir', {holder!r}).acquire()\n"
            "print('locked', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline().strip() == "locked"
        for cmd in (["build"], ["build", "--force"], ["stage", "ingest"]):
            assert main([*cmd, "--config", str(conf)]) == 2
            line = _one_line(capsys.readouterr().err)
            assert line.startswith(f"error: output_dir {tmp_path / 'out'} is in use by another {holder} "
                                   f"(pid {proc.pid} on "), line
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".lock"]
    finally:
        proc.kill()
        proc.wait()
    assert main(["build", "--config", str(conf)]) == 0


@needs_data
def test_ctrl_c_is_one_line_and_resumable(tmp_path, capsys, monkeypatch):
    """Ctrl-C inside the build (delivered right after ingest finishes, not at a time that a fast machine could
    outrun): one line, exit 130, ingest kept; the same command then finishes without redoing ingest."""
    import time

    from data_pipeline.__main__ import main
    from data_pipeline.config import load_config
    from data_pipeline.stages import is_done
    from data_pipeline.stages.bookkeeping import StageRun, work_dir

    text = tmp_path / "big.txt"
    text.write_text(SHAKESPEARE.read_text(encoding="utf-8") * 3, encoding="utf-8")
    conf = _config(tmp_path, "out", sources=[{"type": "text", "path": str(text), "text_mode": "blocks"}])
    finish = StageRun.finish

    def finish_then_ctrl_c(self, *args, **kwargs):
        out = finish(self, *args, **kwargs)
        if self.name != "ingest":
            return out
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # the interrupt lands here, in the middle of the build
        raise AssertionError("SIGINT was not delivered")

    monkeypatch.setattr(StageRun, "finish", finish_then_ctrl_c)
    assert main(["build", "--config", str(conf)]) == 130
    assert _one_line(capsys.readouterr().err).startswith("interrupted: finished work is kept")
    cfg = load_config(conf)
    assert is_done(cfg, "ingest") and not is_done(cfg, "tokenizer")
    monkeypatch.setattr(StageRun, "finish", finish)
    ingest_record = work_dir(cfg, "ingest") / "_stage.json"
    before = ingest_record.stat().st_mtime_ns
    assert main(["build", "--config", str(conf)]) == 0
    assert all(is_done(cfg, s) for s in ("ingest", "tokenizer", "filter", "dedup", "export"))
    assert ingest_record.stat().st_mtime_ns == before  # resumed after ingest, not redone


@needs_data
def test_disk_full_is_one_line(tmp_path):
    """Writes fail with EFBIG past RLIMIT_FSIZE (SIGXFSZ ignored): the OS error a full disk also raises."""
    conf = _config(tmp_path, "out")

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))

    res = subprocess.run([sys.executable, "-m", "data_pipeline", "build", "--config", str(conf)], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300,
                         preexec_fn=limit)
    assert res.returncode == 1, res.stderr
    line = _one_line(res.stderr)
    assert line.startswith("error: File too large: ") and "check free disk space" in line


@needs_data
def test_training_split_without_training_part(tmp_path):
    spec = {"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"), "merges_file": str(GPT2 / "gpt2-merges.txt")}
    res = subprocess.run([sys.executable, "-m", "training.pretrain", "--config", "configs/gpt2_tiny.yaml",
                          "data.corpus=null", f"data.text_files=[{BOTCHAN}]", f"data.tokenizer={json.dumps(spec)}",
                          f"run.dir={tmp_path}", "data.split=0,0,1"], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT)), timeout=120)
    assert res.returncode == 2
    assert _one_line(res.stderr).startswith("config error: data.split='0,0,1' gives the training set no documents")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_taken_port_or_a_missing_launcher_is_one_line(tmp_path, tp):
    """One plain process: its rendezvous port held by another program is one line naming --master_port (was
    torch's DistNetworkError traceback); with parallel.tensor=2 the missing launcher is named first, before any
    port is tried."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "training.pretrain", "--config", "configs/gpt2_tiny.yaml",
                              "optimizer.warmup_iters=0", "train.iters=1", f"parallel.tensor={tp}", f"run.dir={tmp_path}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT), MASTER_PORT=str(port)))
    assert res.returncode == 2, res.stderr
    line = [x for x in res.stderr.splitlines() if x.startswith(("error:", "config error:"))]
    assert len(line) == 1 and "Traceback" not in res.stderr, res.stderr
    if tp == 1:
        assert line[0] == (f"error: the rendezvous port 127.0.0.1:{port} is already in use (EADDRINUSE: another run "
                           f"or service holds it): choose a free one with `deepspeed --master_port N` (MASTER_PORT=N "
                           f"for one process)")
    else:
        assert line[0].startswith("config error: TP x PP = 2 x 1 needs 2 processes and this is one: run under the "
                                  "launcher, `deepspeed --num_gpus 2 --module training.pretrain ...`")


@needs_data
@pytest.mark.parametrize("content,message", [(b"", "is empty"), (b"\x00\x01binary\xff", "is not UTF-8 text")])
def test_training_text_file_empty_or_binary(tmp_path, content, message):
    from training.config import ConfigError, load_config
    from training.data.loader import resolve_sources

    f = tmp_path / "t.txt"
    f.write_bytes(content)
    spec = {"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"), "merges_file": str(GPT2 / "gpt2-merges.txt")}
    cfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", ["data.corpus=null", f"data.text_files=[{f}]",
                                                             f"data.tokenizer={json.dumps(spec)}", f"run.dir={tmp_path}"])
    with pytest.raises(ConfigError, match=message):
        resolve_sources(cfg)


def test_wikitext_one_word_file(tmp_path, capsys):
    from evaluation.cli import main

    (tmp_path / "one.tokens").write_text(" hello \n")
    (tmp_path / "run").mkdir()
    assert main(["wikitext103", "--checkpoint", str(tmp_path / "run"), "--data", str(tmp_path / "one.tokens"),
                 "--no-progress"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: ") and "holds 1 word(s): WikiText perplexity needs at least 2" in line


@needs_data
def test_text_files_cache_is_keyed_by_content(tmp_path):
    """An edit that keeps the size must not reuse the old tokens (the key used to be path + size)."""
    from training.config import load_config
    from training.data.loader import resolve_sources

    f = tmp_path / "t.txt"
    spec = {"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"), "merges_file": str(GPT2 / "gpt2-merges.txt")}
    over = ["data.corpus=null", f"data.text_files=[{f}]", f"data.tokenizer={json.dumps(spec)}", f"run.dir={tmp_path}"]
    f.write_text("the cat sat on the mat\n")
    first = resolve_sources(load_config(ROOT / "configs" / "gpt2_tiny.yaml", over)).prefix
    f.write_text("the dog sat on the mat\n")  # same size, other text
    assert resolve_sources(load_config(ROOT / "configs" / "gpt2_tiny.yaml", over)).prefix != first


def test_latest_and_run_files_are_world_readable(tmp_path):
    """atomic_write_text (checkpoints/latest, config.json) gives the mode open() would, not mkstemp's 0600."""
    from training.checkpoint import atomic_write_text

    atomic_write_text(tmp_path / "latest", "iter_0000001")
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "latest").stat().st_mode & 0o777 == 0o666 & ~umask


@needs_data
@pytest.mark.parametrize("damage", ["corpus_folder", "binary_latest", "missing_tp_shard", "no_run"])
def test_evaluation_on_a_bad_checkpoint_folder_is_one_line(tmp_path, capsys, damage):
    """``python -m evaluation`` given a folder that is not a complete training run: one line, exit 2."""
    from evaluation.cli import main
    from training.config import Config
    from training.models.config import ModelConfig, padded_vocab_size
    from training.models.gpt2 import GPTModel
    from training.parallel_config import ParallelConfig
    from training.tools.import_hf import write_checkpoint

    spec = {"kind": "gpt2_bpe", "vocab_file": str((GPT2 / "gpt2-vocab.json").resolve()),
            "merges_file": str((GPT2 / "gpt2-merges.txt").resolve())}
    model_cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=50257)
    weights = {k: v[:50257] if k.endswith("word_embeddings.weight") else v
               for k, v in GPTModel(model_cfg, padded_vocab_size(50257, 128, 1)).state_dict().items()}
    run = tmp_path / "run"
    write_checkpoint(run, Config(model=model_cfg, parallel=ParallelConfig(tensor=2)), weights, spec, "test")
    folder, expected = run, None
    if damage == "corpus_folder":
        folder = tmp_path / "corpus"
        folder.mkdir()
        (folder / "corpus.json").write_text("{}")
        expected = "is a corpus folder (it holds corpus.json), not a training run"
    elif damage == "binary_latest":
        (run / "checkpoints" / "latest").write_bytes(b"\x80\x81\xfe\x00")
        expected = "latest is not a text file naming a checkpoint"
    elif damage == "missing_tp_shard":
        next((run / "checkpoints").glob("*/mp_rank_01_model_states.pt")).unlink()
        # the tag's completion record names the file; a tag without one (older runs) is counted against TP x PP
        expected = "mp_rank_01_model_states.pt is missing (the completion record lists it)"
    else:
        folder = tmp_path / "nothing"
        expected = "checkpoint directory"
    text = tmp_path / "t.txt"
    text.write_text("one two three four five six seven\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["wikitext103", "--checkpoint", str(folder), "--data", str(text), "--no-progress"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: ") and expected in line, line


BINARY = bytes(range(256)) * 4  # not UTF-8 (0x80 cannot start a character)


@pytest.mark.parametrize("which", ["eval_set", "corpus", "corpus_not_json"])
def test_overlap_on_binary_input_is_one_line(tmp_path, capsys, which):
    from data_pipeline.__main__ import main

    corpus, eval_set = tmp_path / "docs.jsonl", tmp_path / "set.tokens"
    corpus.write_text(json.dumps({"text": "a b c d e f g h i j"}) + "\n", encoding="utf-8")
    eval_set.write_text("a b c d e f g h i j\n", encoding="utf-8")
    expected = {"eval_set": "evaluation file", "corpus": "docs.jsonl:2: not a UTF-8 JSON object",
                "corpus_not_json": "docs.jsonl:2: not a UTF-8 JSON object"}[which]
    if which == "eval_set":
        eval_set.write_bytes(BINARY)
    else:
        with corpus.open("ab") as f:
            f.write(BINARY[128:200] + b"\n" if which == "corpus" else b"[1, 2]\n")
    capsys.readouterr()
    assert main(["overlap", "--corpus", str(corpus), "--against", f"x={eval_set}", "--workers", "1"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: ") and expected in line, line


def test_generate_on_a_binary_prompts_file_is_one_line(tmp_path, capsys):
    from evaluation.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(BINARY)
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompts", str(prompts), "--no-progress"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: --prompts") and "is not UTF-8 text (invalid start byte at byte 128)" in line, line


@needs_data
def test_a_shard_one_rank_cannot_read_stops_every_rank_with_one_line(tmp_path):
    """TP=2 under the launcher: rank 1's checkpoint shard cut short. Rank 1 meets it, every rank raises the same
    error and one line is printed (before: rank 1's line and rank 0's gloo traceback when rank 1 left)."""
    text = tmp_path / "b.txt"
    text.write_text(BOTCHAN.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    spec = {"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"), "merges_file": str(GPT2 / "gpt2-merges.txt")}
    run = tmp_path / "run"

    def launch(iters: int) -> subprocess.CompletedProcess:
        over = {"data.corpus": "null", "data.text_files": f"[{text}]", "data.tokenizer": json.dumps(spec),
                "run.dir": str(run), "train.progress_bar": "false", "model.seq_length": "32", "parallel.tensor": "2",
                "train.micro_batch_size": "2", "train.global_batch_size": "2", "train.iters": str(iters),
                "train.save_interval": "2", "optimizer.warmup_iters": "1"}
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
               "--module", "training.pretrain", "--config", "configs/gpt2_tiny.yaml",
               *[f"{k}={v}" for k, v in over.items()]]
        return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT)),
                              capture_output=True, text=True, timeout=300)

    first = launch(2)
    assert first.returncode == 0, first.stderr[-3000:]
    shard = run / "checkpoints" / "iter_0000002" / "mp_rank_01_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:4096])
    res = launch(4)
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    errors = [x for x in (res.stdout + res.stderr).splitlines() if "checkpoint error:" in x]
    assert len(errors) == 1 and "mp_rank_01_model_states.pt" in errors[0], res.stderr[-3000:]
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]


def _evaluate_missing_run(rank, world, folder):
    import contextlib
    import io

    from evaluation.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["wikitext103", "--tp", "2", "--checkpoint", folder, "--data", __file__, "--no-progress"])
    return code, err.getvalue()


def test_evaluation_error_under_the_launcher_is_printed_once(tmp_path):
    """Every rank meets the same bad input; rank 0 alone prints it (before: once per rank), all exit 2."""
    from tests.helpers.distributed import run_distributed

    (code0, err0), (code1, err1) = run_distributed(_evaluate_missing_run, 2, str(tmp_path / "no-run"))
    assert code0 == code1 == 2
    assert _one_line(err0).startswith("error: checkpoint directory") and err1.strip() == ""


HOSTILE_LINES = {"nested": "[" * 1000 + "]" * 1000,  # 2 KB past Python's stack: RecursionError
                 "huge_number": '{"text": "a b", "n": ' + "9" * 100_000 + "}"}  # past the 4,300-digit int limit


@pytest.mark.parametrize("kind", sorted(HOSTILE_LINES))
def test_a_hostile_json_line_is_one_line_or_a_counted_skip_in_every_reader(tmp_path, kind):
    """Each jsonl reader of user files (LAMBADA, generate --prompts, RACE, overlap's eval sets and corpus) met a line
    nested past the stack or holding a number past Python's digit limit with a RecursionError/ValueError traceback
    (the hostile probe's cases): now the reader's own one-line error, or a counted skip for RACE."""
    from data_pipeline.overlap import OverlapError, iter_corpus_texts, read_eval_texts
    from evaluation.errors import EvalError
    from evaluation.generate import read_prompts
    from evaluation.lambada import read_lambada_jsonl
    from megatron_ds_suite.core.race import read_race_dir

    good, bad = json.dumps({"text": "the cat sat on the mat", "prompt": "hello"}), HOSTILE_LINES[kind]
    f = tmp_path / "x.jsonl"
    f.write_text(f"{good}\n{bad}\n{good}\n", encoding="utf-8")
    reason = "nested too deep" if kind == "nested" else "Exceeds the limit (4300 digits) for integer string conversion"
    with pytest.raises(EvalError, match=rf"x\.jsonl:2: malformed JSON \({re.escape(reason)}"):
        read_lambada_jsonl(f)
    with pytest.raises(EvalError, match=rf"x\.jsonl:2: not JSON \({re.escape(reason)}"):
        read_prompts(f)
    with pytest.raises(OverlapError, match=r"x\.jsonl:2: not a JSON object"):
        read_eval_texts(f)
    with pytest.raises(OverlapError, match=r"x\.jsonl:2: not a UTF-8 JSON object"):
        list(iter_corpus_texts(f))
    race = tmp_path / "RACE" / "dev" / "middle"
    race.mkdir(parents=True)
    (race / "1.txt").write_text(json.dumps({"article": "a b c", "questions": ["q?"], "options": [["a", "b", "c", "d"]],
                                            "answers": ["A"]}))
    (race / "2.txt").write_text(bad)
    qs, rep = read_race_dir(race)
    assert len(qs) == 1 and rep.skipped == 1 and rep.problems == [f"{race / '2.txt'}:1: invalid JSON ({reason})"]


@pytest.mark.parametrize("command", [
    ["python", "-m", "training.pretrain", "--config", "{file}"],
    ["python", "-m", "data_pipeline", "build", "--config", "{file}"],
    ["python", "-m", "megatron_ds_suite.app.main_job", "--config", "{file}"],
])
def test_each_command_refuses_a_deeply_nested_config_file_in_one_line(tmp_path, command):
    root = ROOT
    f = tmp_path / "deep.yaml"
    f.write_text("title: " + "[" * 20000 + "]" * 20000 + "\n")
    cmd = [sys.executable if x == "python" else x.format(file=f) for x in command]
    res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root), "DS_ACCELERATOR": "cpu"})
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "nested deeper than" in lines[0], res.stderr


@needs_data
def test_resuming_with_the_other_split_convention_is_one_line(tmp_path):
    """A run trained with data.split_convention=megatron_lm (the default) and relaunched with megatron_core would
    index other samples from its saved data position: refused in one line, the checkpoint left as it was."""
    text = tmp_path / "b.txt"
    text.write_text(BOTCHAN.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    spec = {"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"), "merges_file": str(GPT2 / "gpt2-merges.txt")}
    args = [sys.executable, "-m", "training.pretrain", "--config", "configs/gpt2_tiny.yaml", "data.corpus=null",
            f"data.text_files=[{text}]", f"data.tokenizer={json.dumps(spec)}", f"run.dir={tmp_path / 'run'}",
            "train.progress_bar=false", "model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=2",
            "optimizer.warmup_iters=0", "train.eval_iters=0", "parallel.tensor=1"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    first = subprocess.run([*args, "train.iters=1"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    res = subprocess.run([*args, "train.iters=2", "data.split_convention=megatron_core"], cwd=ROOT, capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode == 2, res.stderr
    assert re.match(r"config error: checkpoint .*/checkpoints/iter_0000001 was trained with "
                    r"data\.split_convention=megatron_lm but this run sets megatron_core: resume with "
                    r"data\.split_convention=megatron_lm or start a new run\.dir$", _one_line(res.stderr)), res.stderr
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "iter_0000001"
