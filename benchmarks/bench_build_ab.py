"""The corpus build as a user runs it, from several checkouts, interleaved (A B C A B C ...).

Writes the corpus (``--corpus generated|real``, see ``bench_corpus.corpus_texts``) and one config per
checkout (the config of ``bench_corpus --e2e-docs``: SentencePiece BPE 8k trained by the build,
``--workers`` workers, shards of 2,000), then ``--reps`` times, for each ``--root NAME=DIR`` in turn:
removes the output folder and runs ``python -m data_pipeline build --config C`` with ``cwd=DIR`` and
``PYTHONPATH=DIR``. Reports per checkout the wall and CPU seconds (process + workers) of every run,
their medians and the ratio to the first checkout's, the median per-stage seconds from ``stats.json``,
whether the outputs (``.bin``/``.idx``, duplicates, rejects, documents) are byte-identical across
checkouts, and ``uptime`` before and after. An older commit is made a checkout with
``git worktree add --detach /tmp/ab/pre da93c7e`` (or ``git archive da93c7e | tar -x -C DIR``)::

    .venv/bin/python -m benchmarks.bench_build_ab --corpus real --docs 20000 --reps 5 --workers 2 \\
        --root pre=/tmp/ab/pre --root main=/tmp/ab/main --root ours=. [--json benchmarks/results/X.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_corpus import corpus_texts

STAGES = ("ingest", "tokenizer", "filter", "dedup", "export")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def output_digest(out: Path, tmp: Path) -> dict[str, str]:
    """Per output: sha256 of the .bin/.idx, duplicates and rejects files (temp path masked), and of the
    documents' ``(i, text)`` (the digests ``bench_corpus --e2e-docs`` prints)."""
    got = {}
    for name in ("gpt_text_document.bin", "gpt_text_document.idx", "duplicates.jsonl", "rejects.jsonl"):
        got[name] = hashlib.sha256((out / name).read_bytes().replace(str(tmp).encode(), b"<tmp>")).hexdigest()[:12]
    docs = hashlib.sha256()
    with open(out / "documents.jsonl", "rb") as f:
        for line in f:
            r = json.loads(line)
            docs.update(json.dumps([r["i"], r["text"]]).encode())
    got["documents (i, text)"] = docs.hexdigest()[:12]
    return got


def run_build(root: Path, cfg: Path, out: Path) -> tuple[float, float, dict[str, float]]:
    shutil.rmtree(out, ignore_errors=True)
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "data_pipeline", "build", "--config", str(cfg)], cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True)
    wall = time.perf_counter() - t
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode != 0:
        raise SystemExit(f"build from {root} failed:\n{run.stderr[-3000:]}")
    stats = json.loads((out / "stats.json").read_text())
    stages = {k: float(v.get("seconds", 0.0)) for k, v in stats.get("stages", {}).items() if isinstance(v, dict)}
    return wall, c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime, stages


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", choices=("generated", "real"), default="real")
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--root", action="append", required=True, metavar="NAME=DIR",
                    help="a checkout to build from (repeat; the first is the baseline of the ratios)")
    ap.add_argument("--json", default=None, help="also write the measurements here")
    args = ap.parse_args(argv)
    roots = [(r.split("=", 1)[0], Path(r.split("=", 1)[1]).resolve()) for r in args.root]
    texts = corpus_texts(args.corpus, args.docs)
    if texts is None:
        print(f"(skipped: the {args.corpus} corpus needs ../shared/data, which is absent)")
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench_ab_"))
    try:
        inp = tmp / "corpus.jsonl"
        with open(inp, "w", encoding="utf-8") as f:
            for i, text in enumerate(texts):
                f.write(json.dumps({"id": f"doc-{i}", "text": text}) + "\n")
        mb = inp.stat().st_size / 1e6
        cfgs = {}
        for name, _ in roots:
            cfgs[name] = tmp / f"{name}.yaml"
            cfgs[name].write_text(json.dumps({
                "output_dir": str(tmp / "out"), "sources": [{"type": "jsonl", "path": str(inp), "id_field": "id"}],
                "workers": args.workers, "shard_size": 2000, "progress": False,
                "tokenizer": {"vocab_size": 8000, "train_max_docs": 20000}, "dedup": {"chunk_size": 2000}}))
        up0 = uptime()
        print(f"## build A/B: {args.docs} {args.corpus} documents, {mb:.1f} MB jsonl, workers={args.workers}, "
              f"{args.reps} interleaved rounds; uptime at start: {up0}")
        res: dict[str, dict] = {name: {"wall": [], "cpu": [], "stages": [], "digest": None} for name, _ in roots}
        for rep in range(args.reps):
            for name, root in roots:
                wall, cpu, stages = run_build(root, cfgs[name], tmp / "out")
                r = res[name]
                r["wall"].append(round(wall, 3))
                r["cpu"].append(round(cpu, 3))
                r["stages"].append(stages)
                r["digest"] = r["digest"] or output_digest(tmp / "out", tmp)
                print(f"  round {rep + 1} {name}: {wall:.2f} s wall, {cpu:.2f} CPU-s", flush=True)
        up1 = uptime()
        base = roots[0][0]
        med = {n: (statistics.median(r["wall"]), statistics.median(r["cpu"])) for n, r in res.items()}
        print("\n| checkout | wall s per round (median) | CPU s (median) | wall ratio vs "
              f"{base} | CPU ratio | " + " | ".join(f"{s} s" for s in STAGES) + " | outputs |")
        print("|---|---|---|---|---|" + "---|" * len(STAGES) + "---|")
        for name, r in res.items():
            stage_med = [statistics.median(st.get(s, 0.0) for st in r["stages"]) for s in STAGES]
            total = sum(stage_med) or 1.0
            r["stage_median"] = dict(zip(STAGES, stage_med))
            walls = " ".join(f"{w:.2f}" for w in r["wall"])
            print(f"| {name} | {walls} ({med[name][0]:.2f}) | {med[name][1]:.2f} | {med[base][0] / med[name][0]:.2f}x "
                  f"| {med[base][1] / med[name][1]:.2f}x | "
                  + " | ".join(f"{v:.2f} ({100 * v / total:.0f} %)" for v in stage_med)
                  + f" | {'/'.join(r['digest'].values())} |")
        differ = [k for k in res[base]["digest"] if len({r["digest"][k] for r in res.values()}) > 1]
        same = not differ
        print(f"\noutputs identical across checkouts: {same} (differing: {', '.join(differ) or 'none'}); "
              f"uptime at end: {up1}")
        if args.json:
            Path(args.json).write_text(json.dumps({
                "corpus": args.corpus, "docs": args.docs, "mb": mb, "workers": args.workers, "reps": args.reps,
                "roots": {n: str(p) for n, p in roots}, "uptime_start": up0, "uptime_end": up1,
                "identical_outputs": same, "results": res}, indent=1) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
