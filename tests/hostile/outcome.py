"""What the user sees, classified: the message lines of a command's output (:func:`error_lines`), one case's outcome
(:func:`classify`: clean / traceback / silent / hang), the counts and the markdown report of a run.
"""
from __future__ import annotations

import re

from tests.hostile.case import Case
from tests.hostile.probe import Result

OUTCOMES = ("clean", "traceback", "silent", "hang")
AREAS = ("data_pipeline", "training", "evaluation", "tools")

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
