"""RUN/report.md and RUN/training_curve.png from the artefacts the stages wrote.

Sources (nothing is recomputed from the model): the corpus's ``stats.json``, training's
``metrics.jsonl`` / ``config.json`` / ``ds_config.json``, and the evaluation JSON files in RUN/eval.

metrics.jsonl after a resumed run may repeat the iterations between the last checkpoint and the
interruption; :func:`read_metrics` keeps the *last* record of each iteration (the one the final model
descends from). Throughput, TFLOP/s and MFU are means over iterations 2..N (iteration 1 includes
start-up work: allocation, first-touch of the data), or over the only iteration when N = 1.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ds_suite.core import atomic


@dataclass
class ReportInputs:
    run_dir: Path
    flow: str
    title: str
    command: str
    corpus_dir: Path
    train_dir: Path
    train_cfg: Any
    procs: int
    accelerator: str
    stages: list[dict[str, Any]] = field(default_factory=list)
    eval_detail: dict[str, dict[str, Any]] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ reading
def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(steps sorted by iteration, last record per iteration; events, last per (event, iteration))."""
    steps: dict[int, dict[str, Any]] = {}
    events: dict[tuple[str, int], dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if "event" in rec:
                events[(rec["event"], int(rec["iteration"]))] = rec
            else:
                steps[int(rec["iteration"])] = rec
    return [steps[k] for k in sorted(steps)], [events[k] for k in sorted(events, key=lambda x: (x[1], x[0]))]


def throughput(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Means of tokens/s, TFLOP/s per device, MFU and step time over iterations 2..N (see module doc)."""
    use = steps[1:] if len(steps) > 1 else steps

    def mean(key: str) -> float | None:
        vals = [float(s[key]) for s in use if s.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    first, last = (use[0]["iteration"], use[-1]["iteration"]) if use else (0, 0)
    return {"tokens_per_s": mean("tokens_per_s"), "tflops_per_device": mean("tflops_per_device"),
            "mfu": mean("mfu"), "step_time_s": mean("step_time_s"), "from": first, "to": last, "n": len(use)}


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


# ------------------------------------------------------------------------------------------- format
def num(v: Any, digits: int = 4) -> str:
    """Numbers in the report: ints with thousands separators, floats with ``digits`` significant
    decimals (scientific beyond 1e6); None/NaN -> 'n/a'."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if abs(v) >= 1e6:
        return f"{v:.{digits}e}"
    return f"{v:.{digits}f}"


def table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------- plot
def plot_curve(steps: list[dict[str, Any]], events: list[dict[str, Any]], path: Path) -> None:
    """Loss (and validation loss points) and learning rate against iteration, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it = [s["iteration"] for s in steps]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax1.plot(it, [s["loss"] for s in steps], lw=1.2, label="training loss")
    valid = [e for e in events if e.get("event") == "valid"]
    if valid:
        ax1.plot([e["iteration"] for e in valid], [e["loss"] for e in valid], "o", ms=5, label="validation loss")
    ax1.set_ylabel("loss (nats / token)")
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.plot(it, [s["lr"] for s in steps], color="tab:orange", lw=1.2)
    ax2.set_ylabel("learning rate")
    ax2.set_xlabel("iteration")
    ax2.grid(alpha=0.3)
    ax2.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    fig.tight_layout()
    try:
        with atomic.atomic_path(path) as tmp:  # keeps the .png suffix savefig reads the format from
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)


# ------------------------------------------------------------------------------------------- report
def _dtype(ds: dict[str, Any] | None) -> str:
    if not ds:
        return "n/a"
    return "fp16" if ds.get("fp16", {}).get("enabled") else "bf16" if ds.get("bf16", {}).get("enabled") else "fp32"


def eval_rows(run_dir: Path, flow: str, stages: dict[str, dict[str, Any]],  # noqa: C901
              detail: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """Rows ``task | data | metric | value | count`` of the evaluation table."""
    ev = run_dir / "eval"
    rows: list[list[Any]] = []

    def data_cell(task: str, r: dict[str, Any]) -> str:
        d = detail.get(task, {})
        cell = f"`{Path(d.get('source') or r.get('data') or '').name}`"
        return cell + (f" (first {d['limit']:,} {d.get('unit', 'lines')})" if d.get("limit") else "")

    def skipped(task: str) -> bool:
        st = stages.get(task)
        if st and st["status"] == "skipped":
            rows.append([task.removeprefix("eval_"), "—", "skipped", st["summary"], "—"])
            return True
        return False

    if flow == "gpt":
        if not skipped("eval_heldout") and (r := _load(ev / "heldout.json")):
            rows.append(["held-out corpus documents", f"{r['part']} part of split {r['split']} ({r['documents']:,} documents)",
                         "perplexity", num(r["ppl"]), f"{r['tokens']:,} tokens"])
            rows.append(["held-out corpus documents", "", "loss (nats / token)", num(r["loss"]), ""])
        if not skipped("eval_wikitext103") and (r := _load(ev / "wikitext103.json")):
            rows.append(["WikiText-103", data_cell("eval_wikitext103", r), "adjusted perplexity", num(r["adjusted_ppl"]),
                         f"{r['num_original_tokens']:,} original tokens"])
            rows.append(["WikiText-103", "", "token perplexity", num(r["ppl"]), f"{r['num_tokenized_tokens']:,} model tokens"])
        if not skipped("eval_lambada") and (r := _load(ev / "lambada.json")):
            rows.append(["LAMBADA", data_cell("eval_lambada", r), f"{r['mode']} accuracy", num(r["accuracy"]),
                         f"{r['correct']:,} / {r['count']:,}"])
    else:
        if (r := _load(ev / "race.json")):
            for lvl in ("middle", "high"):
                if f"{lvl}/accuracy" in r:
                    rows.append(["RACE", f"{r.get('split')} {lvl}", "accuracy", num(r[f"{lvl}/accuracy"]),
                                 f"{r.get(f'{lvl}/count', '')}"])
            rows.append(["RACE", f"{r.get('split')} all", "accuracy", num(r["accuracy"]), f"{r['count']:,} questions"])
    return rows


def write_report(inp: ReportInputs) -> Path:
    run = inp.run_dir
    stages = {s["name"]: s for s in inp.stages}
    parts: list[str] = [f"# {inp.title}", "",
                        f"Written {time.strftime('%Y-%m-%d %H:%M:%S')} by `{inp.command}`; run directory `{run}`; "
                        f"{inp.flow.upper()} flow on {inp.procs} {'GPU' if inp.accelerator == 'cuda' else 'CPU'} "
                        f"process(es).", ""]

    # stages ------------------------------------------------------------------------------------
    parts += ["## Stages", "",
              "`ran` = run by this invocation, `reused` = finished earlier with the same inputs and settings "
              "(seconds of that earlier run). Full output of each stage: `logs/<stage>.log`.", ""]
    rows = []
    for s in inp.stages:
        if s["name"] == "report":
            continue
        secs = num(s["seconds"], 1) if s["status"] != "skipped" else "—"
        rows.append([s["name"], s["status"], secs, s["summary"].replace("|", "/"),
                     f"`logs/{s['name']}.log`" if s["status"] != "skipped" else "—"])
    parts += [table(["stage", "this run", "seconds", "summary", "log"], rows), ""]

    # corpus --------------------------------------------------------------------------------------
    stats = _load(inp.corpus_dir / "stats.json")
    if stats:
        d, t = stats["documents"], stats["tokens"]
        parts += ["## Corpus", "", f"`{inp.corpus_dir}` (`stats.json`); in = malformed + too short + duplicates + kept: "
                  f"{'yes' if d['reconciles'] else 'NO'}.", "",
                  table(["in", "malformed", "too short", "duplicates", "kept", "tokens kept"],
                        [[num(d["read"]), num(d["malformed"]), num(d["too_short"]), num(d["duplicates"]),
                          num(d["kept"]), num(t["kept"])]]), ""]

    # training ------------------------------------------------------------------------------------
    metrics = inp.train_dir / "metrics.jsonl"
    if metrics.is_file():
        steps, events = read_metrics(metrics)
        cfg = _load(inp.train_dir / "config.json") or {}
        m, tr = cfg.get("model", {}), cfg.get("train", {})
        tp = cfg.get("parallel", {}).get("tensor", 1)
        dp = inp.procs // (tp * cfg.get("parallel", {}).get("pipeline", 1))
        parts += ["## Training", "",
                  table(["model", "layers", "hidden", "heads", "seq length", "vocabulary", "TP", "DP", "global batch",
                         "iterations", "dtype"],
                        [[m.get("arch"), m.get("num_layers"), m.get("hidden_size"), m.get("num_attention_heads"),
                          m.get("seq_length"), num(m.get("vocab_size")), tp, dp, tr.get("global_batch_size"),
                          num(tr.get("iters")), _dtype(_load(inp.train_dir / "ds_config.json"))]]), ""]
        if steps:
            plot_curve(steps, events, run / "training_curve.png")
            valid = [e for e in events if e.get("event") == "valid"]
            losses = [s["loss"] for s in steps]
            parts += ["![training curve: loss and learning rate](training_curve.png)", "",
                      table(["steps logged", "first loss", "final loss", "lowest loss", "final lr", "validation loss",
                             "validation ppl"],
                            [[num(len(steps)), num(losses[0]), num(losses[-1]), num(min(losses)),
                              f"{steps[-1]['lr']:.4e}", num(valid[-1]["loss"]) if valid else "n/a",
                              num(valid[-1]["ppl"]) if valid else "n/a"]]), ""]
            th = throughput(steps)
            mfu = th["mfu"]
            parts += ["### Throughput", "",
                      f"Means over iterations {th['from']}..{th['to']} of `metrics.jsonl` (iteration 1 includes "
                      "start-up). TFLOP/s count model FLOPs (Narayanan et al. 2021, no recomputation); MFU = "
                      "TFLOP/s per device / the device's peak (on CPU: a measured matmul peak).", "",
                      table(["tokens/s", "TFLOP/s per device", "MFU (%)", "step time (s)", "iterations"],
                            [[num(th["tokens_per_s"], 1), num(th["tflops_per_device"], 6),
                              num(100 * mfu if mfu is not None else None, 2), num(th["step_time_s"], 4),
                              num(th["n"])]]), ""]
            peaks = [e for e in events if e.get("event") == "cpu_peak"]
            if peaks:  # training/runtime/cpu_peak.py: all ranks measured together after a barrier
                pk = peaks[-1]
                parts += [f"MFU's CPU peak: {pk['tflops']:.4f} TFLOP/s per rank ({pk['dtype']}; {pk['ranks']} rank(s) "
                          f"x {pk['threads']} thread(s) measuring together for {pk['seconds']:.1f} s after a barrier; "
                          f"ranks {pk['rank_min']:.4f}-{pk['rank_max']:.4f}, within-rank spread "
                          f"{100 * pk['within_rank_spread']:.1f} %).", ""]
    # fine-tuning (BERT flow)
    race_res = _load(run / "race" / "race_results.json")
    if inp.flow == "bert" and race_res is not None:
        splits = [k for k in race_res.get("best", {})]
        rows = [[e["epoch"], num(e["train_loss"])] + [num(e[s]["accuracy"]) for s in splits] +
                ["yes" if e["epoch"] == race_res.get("best_epoch") else ""] for e in race_res.get("epochs", [])]
        parts += ["## RACE fine-tuning", "",
                  f"`race/race_results.json`; the checkpoint kept is the epoch with the best {splits[0]} accuracy.", "",
                  table(["epoch", "train loss"] + [f"{s} accuracy" for s in splits] + ["kept"], rows), ""]

    # evaluation ----------------------------------------------------------------------------------
    rows = eval_rows(run, inp.flow, stages, inp.eval_detail)
    parts += ["## Evaluation", "", table(["task", "data", "metric", "value", "count"], rows) if rows else
              "No evaluation results.", ""]
    out = run / "report.md"
    atomic.write_text(out, "\n".join(parts))
    return out
