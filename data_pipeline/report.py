"""Stage timing, peak memory and the end-of-build summary table."""
from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any


def peak_rss_mib() -> tuple[float, float]:
    """(peak RSS of this process, peak RSS of the largest finished child process) in MiB.

    ``ru_maxrss`` is in KiB on Linux and bytes on macOS; it is a high-water mark, so per-stage values
    are "peak so far" (a stage's own peak is at most this)."""
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / (1024 * 1024)
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    try:  # Linux: VmHWM is this process's own peak; ru_maxrss also carries the peak of the process that
        # exec'd it (a large launcher would show up as every stage's peak)
        with open("/proc/self/status") as f:
            me = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration, ValueError):
        pass
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale
    return round(me, 1), round(kids, 1)


@dataclass
class StageTimer:
    name: str
    docs_in: int = 0
    start: float = field(default_factory=time.perf_counter)

    def finish(self, docs_in: int, **extra: Any) -> dict[str, Any]:
        secs = time.perf_counter() - self.start
        me, kids = peak_rss_mib()
        return {"seconds": round(secs, 3), "docs_in": docs_in,
                "docs_per_s": round(docs_in / secs, 1) if secs > 0 else None,
                "peak_rss_mib": me, "peak_rss_children_mib": kids, **extra}


def summary_table(stats: dict[str, Any]) -> str:
    d = stats["documents"]
    lines = ["", "corpus build summary: " + stats.get("output_dir", ""), ""]
    rows = [("documents read", d["read"]), ("malformed", d["malformed"]), ("too short", d["too_short"]),
            ("duplicates", d["duplicates"]), ("kept", d["kept"]), ("tokens kept", stats["tokens"]["kept"])]
    for reason, n in sorted(stats.get("malformed_by_reason", {}).items()):
        if n:
            rows.insert(2, (f"  malformed: {reason}", n))
    w = max(len(r[0]) for r in rows)
    lines += [f"  {k:<{w}}  {v:>12,}" for k, v in rows]
    lines += ["", f"  {'stage':<10} {'seconds':>9} {'docs in':>10} {'docs/s':>10} {'peak MiB':>9} "
                  f"{'workers MiB':>11}  note"]
    for name, s in stats["stages"].items():
        dps = f"{s['docs_per_s']:,.0f}" if s.get("docs_per_s") else "-"
        note = "reused (finished earlier)" if s.get("reused") else ""
        lines.append(f"  {name:<10} {s['seconds']:>9.2f} {s['docs_in']:>10,} {dps:>10} "
                     f"{s['peak_rss_mib']:>9.0f} {s['peak_rss_children_mib']:>11.0f}  {note}")
    lines.append(f"\n  reconciles: read = malformed + too short + duplicates + kept -> {d['reconciles']}")
    return "\n".join(lines)
