"""``python -m tests.hostile``: choose the cases (``--only``), run each in its scratch folder, print and write the rows
(``--json``, ``--md``); ``--compare`` reports earlier runs side by side.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tests.hostile
import tests.hostile.cases  # noqa: F401 -- importing the families registers every case in CASES
from tests.hostile.case import CASES, Case
from tests.hostile.fixtures import HERE
from tests.hostile.outcome import classify, counts, markdown
from tests.hostile.probe import Probe, Result


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


def main(argv: list[str] | None = None) -> int:  # noqa: C901
    ap = argparse.ArgumentParser(description=tests.hostile.__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
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
