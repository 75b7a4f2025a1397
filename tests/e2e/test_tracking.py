"""Tracking and DeepSpeed options: run.csv / run.wandb / run.tensorboard mapped into DeepSpeed's monitor, the
``deepspeed:`` pass-through (owned keys refused), the step line, progress bars, and a short real run that
writes W&B offline files and CSV files (no network)."""
from __future__ import annotations

import csv
import io
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from training.config import ConfigError, load_config
from training.ds_json import deepspeed_config
from training.metrics import format_line, progress_enabled
from training.tracking import OWNERS, monitor_config, owner_of, wandb_env

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "gpt2_tiny.yaml"


def _cfg(*overrides: str):
    return load_config(TINY, ["data.corpus=null", "data.text_files=[x.txt]", *overrides])


def test_monitor_mapping(tmp_path):
    cfg = _cfg(f"run.dir={tmp_path}", "run.csv=true", "run.wandb.enabled=true", "run.wandb.project=p",
               "run.wandb.entity=team-x", "run.wandb.group=g", "run.wandb.mode=offline", "run.wandb.name=n1")
    ds = deepspeed_config(cfg, dp=1, dtype="fp32")
    assert ds["csv_monitor"] == {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "train"}
    assert ds["wandb"] == {"enabled": True, "project": "p", "team": "team-x", "group": "g"}
    assert "tensorboard" not in ds
    assert wandb_env(cfg) == {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path.resolve()), "WANDB_NAME": "n1"}
    # DeepSpeed accepts the sections as they are
    from deepspeed.monitor.config import get_monitor_config

    mc = get_monitor_config(ds)
    assert mc.enabled and mc.csv_monitor.enabled and mc.wandb.team == "team-x" and not mc.tensorboard.enabled
    plain = _cfg()
    assert monitor_config(plain) == {} and wandb_env(plain) == {}


def test_passthrough_merges_unowned_keys():
    cfg = _cfg("parallel.zero_stage=1", "deepspeed.zero_optimization.overlap_comm=true",
               "deepspeed.communication_data_type=fp32", "deepspeed.wall_clock_breakdown=true",
               "deepspeed.flops_profiler.enabled=true", "deepspeed.fp16.consecutive_hysteresis=true")
    ds = deepspeed_config(cfg, dp=2, dtype="fp16")
    assert ds["zero_optimization"] == {"stage": 1, "overlap_comm": True}  # merged, the derived stage kept
    assert ds["communication_data_type"] == "fp32" and ds["wall_clock_breakdown"] is True
    assert ds["flops_profiler"] == {"enabled": True}
    assert ds["fp16"]["consecutive_hysteresis"] is True and ds["fp16"]["enabled"] is True
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 1
    # DeepSpeed parses the merged JSON
    from deepspeed.runtime.config import DeepSpeedConfig

    assert DeepSpeedConfig({**ds, "train_batch_size": 4, "gradient_accumulation_steps": 1,
                            "train_micro_batch_size_per_gpu": 4}).wall_clock_breakdown is True


@pytest.mark.parametrize("key, owner", [
    ("train_batch_size=16", "train.global_batch_size"),
    ("gradient_accumulation_steps=4", "train.global_batch_size"),
    ("zero_optimization.stage=2", "parallel.zero_stage"),
    ("fp16.enabled=true", "precision.dtype"),
    ("fp16.initial_scale_power=12", "precision.initial_scale_power"),
    ("gradient_clipping=0.5", "optimizer.clip_grad"),
    ("optimizer.type=Adam", "optimizer"),
    ("tensorboard.enabled=true", "run.tensorboard"),
    ("wandb={enabled: true}", "run.wandb"),
])
def test_passthrough_refuses_owned_keys(key, owner):
    name = key.split("=")[0]
    with pytest.raises(ConfigError) as e:
        _cfg(f"deepspeed.{key}")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"deepspeed.{name}") and f"derived from {owner}" in msg


def test_every_derived_key_is_owned():
    """Every key the derived JSON writes is either owned by a config field or a documented default."""
    cfg = _cfg("run.csv=true", "run.wandb.enabled=true", "run.tensorboard=false")

    def leaves(d, prefix=""):
        for k, v in d.items():
            yield from (leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"])

    for dtype in ("fp16", "bf16", "fp32"):
        for key in leaves(deepspeed_config(cfg, dp=1, dtype=dtype)):
            # documented defaults a deepspeed: section may override: we log ourselves, and DeepSpeed's throughput
            # timer would synchronise the device twice per micro-batch
            assert owner_of(key) or key in ("steps_per_print", "timers.throughput.enabled"), key
    assert set(OWNERS) >= {"train_batch_size", "zero_optimization.stage", "fp16.enabled", "wandb", "csv_monitor"}


def test_step_line_has_consumed_samples_and_ms_per_iteration():
    m = {"iteration": 7, "lr": 1e-3, "loss": 2.5, "loss_scale": 1.0, "grad_norm": 0.5, "skipped": 0,
         "tokens_per_s": 1000.0, "tflops_per_device": 0.01, "mfu": 0.1, "consumed_samples": 56, "step_time_s": 0.25}
    line = format_line(m, 10)
    assert line.startswith("iter      7/10 | consumed samples 56 | ms/iter 250.0 | lr 1.000e-03 | loss 2.5000")


def test_progress_bar_follows_the_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert progress_enabled(None, Tty()) is True
    assert progress_enabled(None, io.StringIO()) is False  # a log file: no bar
    assert progress_enabled(True, io.StringIO()) is True and progress_enabled(False, Tty()) is False
    assert _cfg().train.progress_bar is None


def _corpus(tmp_path: Path) -> tuple[Path, dict]:
    from data_pipeline.tokenizer_train import train_sentencepiece

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8))) for _ in range(500)]
    blocks = [" ".join(rng.choice(words) for _ in range(rng.randint(60, 120))) for _ in range(60)]
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(blocks) + "\n")
    tok = train_sentencepiece([b for b in blocks], tmp_path / "spm", vocab_size=300, flavor="gpt", seed=1)
    return text, tok.spec()


def wandb_records(path):
    """The ``Record`` protobufs of a W&B offline run file (``run-*.wandb``): LevelDB-log framing (a 7-byte header,
    then 32 KiB blocks of records: crc32, length, type FULL/FIRST/MIDDLE/LAST)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", raw[:7]
    data, block, pos, parts = raw[7:], 32768, 0, b""
    pos_in_block = 7
    while pos + 7 <= len(data):
        if block - pos_in_block < 7:  # block trailer
            pos += block - pos_in_block
            pos_in_block = 0
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pos_in_block = (pos_in_block + 7 + length) % block
        if kind == 0 and length == 0:
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind not in (1, 4):
            continue
        record = pb.Record()
        record.ParseFromString(parts)
        yield record


def wandb_history(path) -> dict[int, dict]:
    """{step: {key: value}} of a W&B offline run file."""
    rows = {}
    for record in wandb_records(path):
        if record.HasField("history"):
            row = rows.setdefault(record.history.step.num, {})
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if key and not key.startswith("_"):
                    row[key] = json.loads(item.value_json)
    return rows


def wandb_run(path) -> tuple[str, dict]:
    """(run id, {config key: value}) of a W&B offline run file."""
    run_id, config = "", {}
    for record in wandb_records(path):
        if record.HasField("run"):
            run_id = run_id or record.run.run_id
        if record.HasField("config"):
            for item in record.config.update:
                key = item.key or "/".join(item.nested_key)
                if key and not key.startswith("_"):
                    config[key] = json.loads(item.value_json)
    return run_id, config


def test_short_run_writes_wandb_offline_and_csv(tmp_path):
    """A real 3-step run (one process) with run.csv and run.wandb in offline mode: W&B's local run files and
    DeepSpeed's CSV files appear, the CSV losses equal metrics.jsonl, the step line has the new fields, and the
    losses, MFU and validation loss read back from the offline W&B run equal metrics.jsonl (issue 29)."""
    pytest.importorskip("wandb")
    text, spec = _corpus(tmp_path)
    run_dir = tmp_path / "run"
    overrides = ["data.corpus=null", f"data.text_files=[{text}]", f"data.tokenizer={json.dumps(spec)}",
                 f"run.dir={run_dir}", "parallel.tensor=1", "train.iters=3", "train.micro_batch_size=2",
                 "train.global_batch_size=4", "model.seq_length=32", "optimizer.warmup_iters=1",
                 "run.csv=true", "run.wandb.enabled=true", "run.wandb.mode=offline", "run.wandb.project=ci",
                 "run.device_peak_tflops=1.0", "deepspeed.wall_clock_breakdown=false"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"), WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
               MASTER_PORT=str(29500 + os.getpid() % 1000))
    out = subprocess.run([sys.executable, "-m", "training.pretrain", "--config", str(TINY), *overrides], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    assert "consumed samples 12 | ms/iter" in out.stdout  # the last step line

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["iteration"]: r["loss"] for r in steps if "event" not in r}
    assert sorted(losses) == [1, 2, 3]
    with open(run_dir / "csv" / "train" / "train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "loss"]
    # one step axis for every sink: consumed samples (global batch 4 per iteration)
    assert {int(s): float(v) for s, v in rows[1:]} == pytest.approx({4 * it: v for it, v in losses.items()})
    with open(run_dir / "csv" / "train" / "train_lr.csv") as f:  # numbers, not a device tensor's repr
        lrs = {int(s): float(v) for s, v in list(csv.reader(f))[1:]}
    assert lrs == pytest.approx({4 * r["iteration"]: r["lr"] for r in steps if "event" not in r})
    assert not list((run_dir / "csv").rglob("Train_Samples_*"))  # DeepSpeed's per-step writes are stopped

    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (data,) = offline.glob("run-*.wandb")
    history = wandb_history(data)
    # our metrics reached W&B (before, every one was dropped: logged by iteration below DeepSpeed's samples step)
    logged = {step: row["train/loss"] for step, row in history.items() if "train/loss" in row}
    assert logged == pytest.approx({4 * it: v for it, v in losses.items()})
    mfu = {r["iteration"]: r["mfu"] for r in steps if "event" not in r}
    assert {step: row["train/mfu"] for step, row in history.items() if "train/mfu" in row} == \
        pytest.approx({4 * it: v for it, v in mfu.items()})
    assert {row["train/iteration"] for row in history.values() if "train/iteration" in row} == {1, 2, 3}
    # memory on every log line: the process's peak resident set on CPU (a GPU's allocated peak there), in GiB
    memory = {4 * r["iteration"]: r["memory_gib"] for r in steps if "event" not in r}
    assert all(0.1 < v < 64 for v in memory.values()) and list(memory.values()) == sorted(memory.values())
    assert {step: row["train/memory_gib"] for step, row in history.items() if "train/memory_gib" in row} == \
        pytest.approx(memory)
    assert re.search(r"\| mem [0-9.]+ GiB", out.stdout + out.stderr)
    valid = [r for r in steps if r.get("event") == "valid"]
    assert valid and history[12]["valid/loss"] == pytest.approx(valid[-1]["loss"])
    assert {step: row["train/lr"] for step, row in history.items() if "train/lr" in row} == \
        pytest.approx({4 * r["iteration"]: r["lr"] for r in steps if "event" not in r})
    # DeepSpeed's own per-step writes are stopped (a host read per step, a stale device loss scale): ours only
    assert not any(k.startswith("Train/Samples/") for row in history.values() for k in row)
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["wandb"]["project"] == "ci" and ds["wall_clock_breakdown"] is False

    # the run's configuration in W&B, and its id kept in the run directory: a resumed launch continues that run
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    first_id, config = wandb_run(data)
    assert first_id == run_id and config["train"]["iters"] == 3 and config["parallel"]["tensor"] == 1
    again = subprocess.run([sys.executable, "-m", "training.pretrain", "--config", str(TINY), *overrides,
                            "train.iters=5"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:] + again.stdout[-3000:]
    (later,) = [d for d in (run_dir / "wandb").glob("offline-run-*") if d != offline]
    (data2,) = later.glob("run-*.wandb")
    assert wandb_run(data2)[0] == run_id and later.name.endswith(run_id)
    assert {step for step, row in wandb_history(data2).items() if "train/loss" in row} == {16, 20}


def test_unreachable_wandb_server_falls_back_to_offline(tmp_path, monkeypatch, caplog):
    """An online W&B run whose server refuses connections is logged offline with one warning, at once (instead
    of wandb.init stalling ~100 s and failing the run); a reachable server keeps the run online."""
    import logging
    import socket
    import time

    from training import tracking

    for key in ("WANDB_MODE", "WANDB_DIR", "WANDB_NAME"):
        monkeypatch.delenv(key, raising=False)  # restored after the test: start() writes os.environ
    cfg = _cfg(f"run.dir={tmp_path / 'run'}", "run.wandb.enabled=true", "run.wandb.mode=online")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed}")
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="training"):
        tracking.start(cfg)
    assert time.perf_counter() - t0 < 5
    assert os.environ["WANDB_MODE"] == "offline" and os.environ["WANDB_DIR"] == str((tmp_path / "run").resolve())
    (warning,) = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert f"127.0.0.1:{closed}" in warning and "wandb sync" in warning

    with socket.socket() as server:  # a server that accepts: online stays online
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        tracking.start(cfg)
    assert os.environ["WANDB_MODE"] == "online"


@pytest.mark.parametrize("override, key, hint", [
    ("deepspeed.wall_clock_breakdwn=true", "deepspeed.wall_clock_breakdwn", "'wall_clock_breakdown'"),
    ("deepspeed.zero_optimization.overlap_com=true", "deepspeed.zero_optimization.overlap_com", "'overlap_comm'"),
    ("deepspeed.flops_profiler.profile_stp=3", "deepspeed.flops_profiler.profile_stp", "'profile_step'"),
    # (zero_optimization.offload_optimizer is owned by parallel.offload_optimizer now: refused naming it)
    ("deepspeed.zero_optimization.offload_param.devic=cpu", "deepspeed.zero_optimization.offload_param.devic",
     "'device'"),
])
def test_passthrough_refuses_a_key_deepspeed_does_not_know(override, key, hint):
    """A typo in the deepspeed: section is refused in one line naming the closest key DeepSpeed itself reads."""
    with pytest.raises(ConfigError) as e:
        _cfg("parallel.zero_stage=1", override)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{key} is not a DeepSpeed option") and f"did you mean {hint}" in msg


def test_passthrough_known_set_comes_from_deepspeed(monkeypatch):
    """The known keys follow the installed DeepSpeed: a key it starts reading is accepted without a list here."""
    from deepspeed.runtime import config as ds_config

    with pytest.raises(ConfigError):
        _cfg("deepspeed.brand_new_option=1")
    real = ds_config.get_dump_state
    monkeypatch.setattr(ds_config, "get_dump_state", lambda d: (d.get("brand_new_option"), real(d))[1])
    assert _cfg("deepspeed.brand_new_option=1").deepspeed == {"brand_new_option": 1}


@pytest.mark.parametrize("override, want", [
    ("deepspeed.steps_per_print=often", "deepspeed.steps_per_print='often': DeepSpeed reads a number there"),
    ("deepspeed.wall_clock_breakdown=7", "deepspeed.wall_clock_breakdown=7: DeepSpeed reads true or false there"),
])
def test_passthrough_refuses_a_scalar_of_the_wrong_type(override, want):
    """A scalar DeepSpeed reads without a type check (``steps_per_print: often``) was accepted and failed in the
    engine with a TypeError traceback on every rank; refused in one line with the type DeepSpeed's default has."""
    with pytest.raises(ConfigError) as e:
        _cfg(override)
    assert "\n" not in str(e.value) and str(e.value).startswith(want), str(e.value)
    assert _cfg("deepspeed.steps_per_print=5", "deepspeed.wall_clock_breakdown=true").deepspeed == {
        "steps_per_print": 5, "wall_clock_breakdown": True}
