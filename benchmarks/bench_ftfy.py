"""ftfy's cost on the real-text corpus, four ways, CPU seconds (``time.process_time``), interleaved.

1. ``ftfy.fix_text`` on every document; 2. the pre-issue-31 fast path (ftfy on any document holding a
character outside printable ASCII + TAB/LF/FF, or ``&``); 3. ``ftfy_fast.needs_ftfy`` per document;
4. ``ftfy_fast.fix_text`` (per line, curly-quote-only lines by ftfy's ``is_bad`` + ``uncurl_quotes``).
Asserts 4 equals 1 on every document::

    .venv/bin/python -m benchmarks.bench_ftfy --docs 3000 --reps 3
"""
from __future__ import annotations

import argparse
import re
import statistics
import time

import ftfy

from benchmarks.real_corpus import real_text_corpus
from data_pipeline.ftfy_fast import fix_text, needs_ftfy

PRE_ISSUE = re.compile(r"[^\t\n\x0c\x20-\x25\x27-\x7e]")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    docs = real_text_corpus(args.docs)
    if docs is None:
        print("(skipped: the real-text corpus needs ../shared/data, which is absent)")
        return
    ways = {"ftfy.fix_text on every document": ftfy.fix_text,
            "pre-issue fast path (non-ASCII or '&' -> ftfy)": lambda x: ftfy.fix_text(x) if PRE_ISSUE.search(x) else x,
            "needs_ftfy per document": lambda x: ftfy.fix_text(x) if needs_ftfy(x) else x,
            "ftfy_fast.fix_text (per line, quotes shortcut)": fix_text}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.reps):
        for name, f in ways.items():
            t = time.process_time()
            for d in docs:
                f(d)
            times[name].append(time.process_time() - t)
    ref = [ftfy.fix_text(d) for d in docs]
    assert [fix_text(d) for d in docs] == ref
    print(f"{len(docs)} real-text documents, {sum(map(len, docs)) / 1e6:.1f} M characters; ftfy changes "
          f"{sum(a != b for a, b in zip(ref, docs))}; needs_ftfy {sum(map(needs_ftfy, docs))}; the pre-issue path "
          f"calls ftfy on {sum(bool(PRE_ISSUE.search(d)) for d in docs)}")
    print("| way | CPU s (median) | repetitions |\n|---|---|---|")
    for name, v in times.items():
        print(f"| {name} | {statistics.median(v):.2f} | {' '.join(f'{x:.2f}' for x in v)} |")


if __name__ == "__main__":
    main()
