"""End to end: the main job (configs/main/ci.yaml) through its real stage CLIs, in a temporary run dir.

One module fixture runs the job, interrupts it (SIGINT, like Ctrl-C) once training has written its
first checkpoint, and reruns it to the end. The tests then check the artefacts, every number of
report.md against stats.json / metrics.jsonl / the evaluation JSON (read here independently), the
held-out perplexity against a plain-torch cross-entropy of the checkpoint on the test documents, a
rerun that reuses every stage, and that a changed training config re-runs training but not the corpus.
WikiText-103 / LAMBADA use short cuts of the real files in ../shared/data/eval (skipped when absent).
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT / ".." / "shared" / "data"
HAVE_EVAL = (SHARED / "eval" / "wikitext-103" / "wiki.test.tokens").is_file() and \
    (SHARED / "eval" / "lambada" / "lambada_test.jsonl").is_file()
CONFIG = "configs/main/ci.yaml"
STAGES = ["corpus", "train", "eval_heldout", "eval_wikitext103", "eval_lambada"]


def job_cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megatron_ds_suite.app.main_job", "--config", CONFIG, "-q", f"run_dir={run_dir}",
            *overrides]


def run_job(run_dir: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    return subprocess.run(job_cmd(run_dir, *overrides), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def wait_for(path: Path, pattern: str, timeout: float, proc: subprocess.Popen) -> bool:
    t0 = time.time()
    rx = re.compile(pattern)
    while time.time() - t0 < timeout and proc.poll() is None:
        if path.is_file() and rx.search(path.read_text(errors="replace")):
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    run = tmp_path_factory.mktemp("main") / "run"
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    # 1) start, and interrupt once training has saved its first checkpoint (iteration 6 of 12)
    out1 = run.parent / "run1.out"
    with open(out1, "w") as f:
        p = subprocess.Popen(job_cmd(run), cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        saw = wait_for(run / "logs" / "train.log", r"saved checkpoint", 400, p)
        p.send_signal(signal.SIGINT)
        rc1 = p.wait(timeout=120)
    state1 = json.loads((run / "state.json").read_text())
    # 2) rerun to the end
    r2 = run_job(run)
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    return {"run": run, "rc1": rc1, "saw_checkpoint": saw, "out1": out1.read_text(), "state1": state1,
            "out2": r2.stdout + r2.stderr}


# ------------------------------------------------------------------------------------------ helpers
def md_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Markdown tables of report.md as (header, rows)."""
    tables, cur = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cur is None:
                cur = (cells, [])
                tables.append(cur)
            elif not all(set(c) <= {"-"} for c in cells):
                cur[1].append(cells)
        else:
            cur = None
    return tables


def table_with(text: str, first_header: str, *more: str) -> list[dict[str, str]]:
    for header, rows in md_tables(text):
        if header[0] == first_header and all(m in header for m in more):
            return [dict(zip(header, r)) for r in rows]
    raise AssertionError(f"no table starting with {first_header!r} in report.md")


def f(cell: str) -> float:
    return float(cell.replace(",", ""))


def close(cell: str, value: float, decimals: int) -> None:
    """``cell`` shows ``value`` rounded to ``decimals`` decimals (or 4 significant digits in e-notation)."""
    x = f(cell)
    if "e" in cell:
        assert math.isclose(x, value, rel_tol=6e-5), (cell, value)
    else:
        assert abs(x - value) <= 0.5 * 10 ** -decimals + 1e-9 * abs(value), (cell, value)


def metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """Independent reading of metrics.jsonl: the last record of each iteration wins."""
    steps, events = {}, {}
    for line in (run / "train" / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        (events if "event" in r else steps)[(r.get("event"), r["iteration"])] = r
    return [steps[k] for k in sorted(steps, key=lambda k: k[1])], [events[k] for k in sorted(events, key=lambda k: k[1])]


# -------------------------------------------------------------------------------------------- tests
def test_interrupt_then_rerun_finishes(job):
    assert job["saw_checkpoint"], "training never saved a checkpoint\n" + job["out1"][-3000:]
    assert job["rc1"] == 130, job["out1"][-3000:]
    interrupted = [s for s, r in job["state1"].items() if r.get("status") == "interrupted"]
    assert len(interrupted) == 1, job["state1"]
    assert "interrupted" in job["out1"] and "rerun the same command" in job["out1"]
    assert job["state1"]["corpus"]["status"] == "done"
    assert re.search(r"corpus\s+reused", job["out2"]), job["out2"]
    if interrupted == ["train"]:
        assert "resuming from checkpoint iteration 6" in job["out2"], job["out2"]
    state = json.loads((job["run"] / "state.json").read_text())
    for s in STAGES[:3]:
        assert state[s]["status"] == "done"


def test_artefacts_exist(job):
    run = job["run"]
    for rel in ["corpus/stats.json", "corpus/corpus.json", "corpus/documents.jsonl", "corpus/gpt_text_document.bin",
                "corpus/gpt_text_document.idx", "train/metrics.jsonl", "train/config.json", "train/ds_config.json",
                "train/checkpoints/latest", "eval/heldout.json", "report.md", "training_curve.png", "state.json"]:
        assert (run / rel).is_file(), rel
    assert (run / "train" / "checkpoints" / "latest").read_text().strip() == "iter_0000012"
    assert len(list((run / "train" / "checkpoints" / "iter_0000012").glob("mp_rank_*_model_states.pt"))) == 2  # TP=2
    png = (run / "training_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    for s in STAGES[:3]:
        assert (run / "logs" / f"{s}.log").stat().st_size > 0
    if HAVE_EVAL:
        assert (run / "eval" / "wikitext103.json").is_file() and (run / "eval" / "lambada.json").is_file()


def test_report_numbers_finite_and_consistent(job):
    run = job["run"]
    text = (run / "report.md").read_text()
    assert not re.search(r"\b(nan|inf|n/a)\b", text, re.I), "non-finite or missing number in report.md"
    for tok in re.findall(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?", text):
        assert math.isfinite(f(tok)), tok

    # corpus table == stats.json
    stats = json.loads((run / "corpus" / "stats.json").read_text())
    d = stats["documents"]
    (row,) = table_with(text, "in", "kept")
    assert [f(row[k]) for k in ("in", "malformed", "too short", "duplicates", "kept", "tokens kept")] == \
        [d["read"], d["malformed"], d["too_short"], d["duplicates"], d["kept"], stats["tokens"]["kept"]]
    assert d["read"] == d["malformed"] + d["too_short"] + d["duplicates"] + d["kept"]

    # training tables == metrics.jsonl / config
    steps, events = metrics(run)
    assert [s["iteration"] for s in steps] == list(range(1, 13))
    (row,) = table_with(text, "steps logged")
    assert f(row["steps logged"]) == 12
    close(row["first loss"], steps[0]["loss"], 4)
    close(row["final loss"], steps[-1]["loss"], 4)
    close(row["lowest loss"], min(s["loss"] for s in steps), 4)
    close(row["final lr"], steps[-1]["lr"], 4)
    valid = [e for e in events if e["event"] == "valid"]
    close(row["validation loss"], valid[-1]["loss"], 4)
    close(row["validation ppl"], valid[-1]["ppl"], 4)
    assert math.isclose(valid[-1]["ppl"], math.exp(valid[-1]["loss"]), rel_tol=1e-6)
    (row,) = table_with(text, "model", "TP")
    assert (row["TP"], row["DP"], row["iterations"], row["global batch"]) == ("2", "1", "12", "8")

    # throughput: means over iterations 2..12
    later = steps[1:]
    (row,) = table_with(text, "tokens/s")
    close(row["tokens/s"], np.mean([s["tokens_per_s"] for s in later]), 1)
    close(row["TFLOP/s per device"], np.mean([s["tflops_per_device"] for s in later]), 6)
    close(row["MFU (%)"], 100 * np.mean([s["mfu"] for s in later]), 2)
    close(row["step time (s)"], np.mean([s["step_time_s"] for s in later]), 4)
    assert f(row["iterations"]) == 11
    for s in later:  # the metrics themselves are coherent: tokens/s = global batch x seq / step time
        assert math.isclose(s["tokens_per_s"], 8 * 64 / s["step_time_s"], rel_tol=1e-6)
    # MFU's CPU peak: both ranks measured together (training/runtime/cpu_peak.py); the report prints the last one
    peaks = [e for e in events if e["event"] == "cpu_peak"]
    assert peaks and all(p["ranks"] == 2 and p["rank_min"] <= p["tflops"] <= p["rank_max"] for p in peaks)
    assert f"MFU's CPU peak: {peaks[-1]['tflops']:.4f} TFLOP/s per rank" in text
    assert math.isclose(steps[-1]["mfu"], steps[-1]["tflops_per_device"] / peaks[-1]["tflops"], rel_tol=1e-9)

    # evaluation table == evaluation JSON
    rows = table_with(text, "task", "metric", "value")
    by = {(r["task"], r["metric"]): r for r in rows}
    h = json.loads((run / "eval" / "heldout.json").read_text())
    close(by[("held-out corpus documents", "perplexity")]["value"], h["ppl"], 4)
    close(by[("held-out corpus documents", "loss (nats / token)")]["value"], h["loss"], 4)
    assert f(by[("held-out corpus documents", "perplexity")]["count"].split()[0]) == h["tokens"]
    if HAVE_EVAL:
        w = json.loads((run / "eval" / "wikitext103.json").read_text())
        close(by[("WikiText-103", "adjusted perplexity")]["value"], w["adjusted_ppl"], 4)
        close(by[("WikiText-103", "token perplexity")]["value"], w["ppl"], 4)
        assert "wiki.test.tokens" in by[("WikiText-103", "adjusted perplexity")]["data"]
        assert "first 60 lines" in by[("WikiText-103", "adjusted perplexity")]["data"]
        with open(SHARED / "eval" / "wikitext-103" / "wiki.test.tokens", encoding="utf-8") as fh:
            first60 = "".join(line for _, line in zip(range(60), fh))
        assert w["num_original_tokens"] == len(first60.strip().split(" "))  # the cut the job made
        la = json.loads((run / "eval" / "lambada.json").read_text())
        r = by[("LAMBADA", "strict accuracy")]
        close(r["value"], la["accuracy"], 4)
        assert r["count"] == f"{la['correct']} / {la['count']}" and la["count"] == 40
        assert la["accuracy"] == la["correct"] / la["count"]

    # stage timings are finite and positive for stages that ran
    for r in table_with(text, "stage", "this run"):
        assert r["this run"] in ("ran", "reused", "skipped")
        if r["this run"] != "skipped":
            assert f(r["seconds"]) >= 0


def test_heldout_perplexity_matches_plain_torch(job):
    """heldout.json (evaluation's windowed scorer) == cross-entropy of the merged checkpoint computed here."""
    import torch
    import torch.nn.functional as F

    from megatron_ds_suite.core.indexed_dataset import MMapIndexedDataset
    from training.checkpoint_reader import load_model_for_eval
    from training.data.gpt_dataset import split_boundaries

    run = job["run"]
    h = json.loads((run / "eval" / "heldout.json").read_text())
    model, cfg, tok = load_model_for_eval(run / "train")
    ds = MMapIndexedDataset(run / "corpus" / "gpt_text_document")
    assert len(ds) == ds.num_documents  # GPT corpus: one item per document
    b = split_boundaries("80,10,10", ds.num_documents)
    stream = torch.from_numpy(np.concatenate([np.asarray(ds[i], dtype=np.int64) for i in range(b[2], b[3])]))
    assert h["documents"] == b[3] - b[2] and h["tokens"] == len(stream)
    L, total, n = cfg.model.seq_length, 0.0, 0
    with torch.no_grad():
        for s in range(0, len(stream) - 1, L):
            inp, lab = stream[s:s + L], stream[s + 1:s + L + 1]
            inp = inp[:len(lab)]
            logits = model(inp[None])[0, :, :tok.vocab_size].double()
            total += float(F.cross_entropy(logits, lab, reduction="sum"))
            n += len(lab)
    assert n == len(stream) - 1 == h["scored_targets"]
    assert math.isclose(h["loss"], total / n, rel_tol=1e-5), (h["loss"], total / n)
    assert math.isclose(h["ppl"], math.exp(total / n), rel_tol=1e-5)


def test_rerun_reuses_every_stage(job):
    run = job["run"]
    watched = ["corpus/stats.json", "train/metrics.jsonl", "train/checkpoints/latest", "eval/heldout.json"]
    if HAVE_EVAL:
        watched += ["eval/wikitext103.json", "eval/lambada.json"]
    before = {p: (run / p).stat().st_mtime_ns for p in watched}
    r = run_job(run)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    expected = STAGES if HAVE_EVAL else STAGES[:3]
    for s in expected:
        assert re.search(rf"\] {s}\s+reused: finished earlier with the same inputs and settings", r.stdout), (s, r.stdout)
    assert " done in " not in r.stdout
    assert {p: (run / p).stat().st_mtime_ns for p in watched} == before
    rows = table_with((run / "report.md").read_text(), "stage", "this run")
    assert {x["stage"]: x["this run"] for x in rows} == {s: "reused" for s in expected} | (
        {} if HAVE_EVAL else {"eval_wikitext103": "skipped", "eval_lambada": "skipped"})


def test_changed_training_config_retrains_but_keeps_corpus(job):
    run = job["run"]
    stats_mtime = (run / "corpus" / "stats.json").stat().st_mtime_ns
    r = run_job(run, "train.set.train.iters=6", "eval.heldout.enabled=false", "eval.wikitext103.enabled=false",
                "eval.lambada.enabled=false")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"\] corpus\s+reused", r.stdout), r.stdout
    assert re.search(r"\] train\s+done in", r.stdout), r.stdout
    assert (run / "corpus" / "stats.json").stat().st_mtime_ns == stats_mtime
    assert (run / "train" / "checkpoints" / "latest").read_text().strip() == "iter_0000006"
    steps, _ = metrics(run)
    assert [s["iteration"] for s in steps] == list(range(1, 7))  # a fresh run, not a resumed one


def test_bad_config_fails_before_work(tmp_path):
    r = run_job(tmp_path / "bad", "train.set.train.itrs=5")
    assert r.returncode == 2 and "train.itrs" in r.stderr and "config error" in r.stderr
    assert not (tmp_path / "bad" / "logs").exists()
    r = run_job(tmp_path / "bad", "eval.lambada.limitt=3")
    assert r.returncode == 2 and "eval.lambada.limitt" in r.stderr
