"""Command line of the corpus builder.

    python -m data_pipeline build  --config configs/data/default.yaml [key.sub=value ...] [--force]
    python -m data_pipeline stage  dedup --config configs/data/default.yaml dedup.threshold=0.8
    python -m data_pipeline status --config configs/data/default.yaml
    python -m data_pipeline overlap --corpus DIR --against wikitext103=FILE lambada=FILE [--n 8]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from data_pipeline.config import ConfigError, load_config
from data_pipeline.files import atomic_write_json
from data_pipeline.overlap import OverlapError, overlap_report, parse_against
from data_pipeline.stages import STAGES, StageError, build, fingerprint, is_done, run_stage, summary_table
from megatron_ds_suite.core.corpus import CorpusError
from megatron_ds_suite.core.errors import SuiteError
from megatron_ds_suite.core.indexed_dataset import IndexedDatasetError
from megatron_ds_suite.core.program import prog as program
from megatron_ds_suite.core.program import stderr_is_terminal
from megatron_ds_suite.core.tokenizer import TokenizerError


def main(argv: list[str] | None = None) -> int:  # noqa: C901
    p = argparse.ArgumentParser(prog=program("python -m data_pipeline"), description="Build a training corpus.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="run every unfinished stage")
    b.add_argument("--force", action="store_true", help="recompute every stage")
    s = sub.add_parser("stage", help="run one stage now (its upstream stages must be finished)")
    s.add_argument("name", choices=STAGES)
    st = sub.add_parser("status", help="which stages are finished for this config")
    o = sub.add_parser("overlap", help="percentage of each evaluation set's word n-grams found in a corpus")
    o.add_argument("--corpus", required=True, help="built corpus folder (documents.jsonl), or jsonl file/folder")
    o.add_argument("--against", required=True, nargs="+", metavar="NAME=FILE",
                   help="evaluation sets, e.g. wikitext103=wiki.test.tokens lambada=lambada_test.jsonl")
    o.add_argument("--n", type=int, default=8, help="n-gram length in words (default 8, the paper's check)")
    o.add_argument("--workers", type=int, default=0, help="processes (0 = all cores)")
    o.add_argument("--output", default=None, help="also write the report as JSON here")
    o.add_argument("-v", "--verbose", action="store_true")
    for a in (b, s, st):
        a.add_argument("--config", required=True, help="YAML file, e.g. configs/data/default.yaml")
        a.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. dedup.threshold=0.8")
        a.add_argument("-v", "--verbose", action="store_true")
    # overrides may follow --config (`stage dedup --config C dedup.threshold=0.8`, as documented), where
    # argparse has already closed the positional list: collect key=value leftovers, refuse anything else
    args, extra = p.parse_known_args(argv)
    takes_overrides = hasattr(args, "overrides")  # every subcommand with --config; not `overlap`
    unknown = [x for x in extra if x.startswith("-") or "=" not in x or not takes_overrides]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    if takes_overrides:
        args.overrides = list(args.overrides) + extra
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "overlap":
        return _overlap(args)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.cmd == "status":
            for name in STAGES:
                print(f"{name:<10} {'done' if is_done(cfg, name) else 'to do':<6} {fingerprint(cfg, name)}")
            return 0
        if args.cmd == "stage":
            run_stage(cfg, args.name)
            print(f"stage {args.name} finished; run `build` to redo the stages after it")
            return 0
        out, stats = build(cfg, force=args.force)
        print(summary_table(stats))
        print(f"\n  output: {out}  (stats.json, documents.jsonl, duplicates.jsonl, rejects.jsonl, corpus.json)")
        return 0
    except (ConfigError, StageError, TokenizerError, CorpusError, IndexedDatasetError, SuiteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # finished stages and shards are kept; rerun the same command to resume
        print("interrupted: finished work is kept, rerun the same command to resume", file=sys.stderr)
        return 130
    except OSError as e:  # disk full, permission denied, a file vanished: the OS's one line
        print(f"error: {e.strerror or e}: {e.filename or 'output'} (check free disk space and permissions), then "
              f"rerun the same command to resume", file=sys.stderr)
        return 1


def _overlap(args: argparse.Namespace) -> int:
    try:
        if args.n < 1:
            raise OverlapError(f"--n must be >= 1, got {args.n}")
        rep = overlap_report(Path(args.corpus), parse_against(args.against), args.n,
                             args.workers or os.cpu_count() or 1, progress=stderr_is_terminal())
    except OverlapError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the scan writes nothing until it ends
        print("interrupted: nothing was written; rerun the same command", file=sys.stderr)
        return 130
    print(f"\n{rep['n']}-gram overlap with {rep['corpus']} ({rep['documents']:,} documents)")
    print(f"  {'set':<16} {'n-grams':>10} {'found':>10} {'overlap %':>10}")
    for name, r in rep["sets"].items():
        print(f"  {name:<16} {r['ngrams']:>10,} {r['found']:>10,} {r['percent']:>10.2f}")
    if args.output:
        atomic_write_json(Path(args.output), rep)
    else:
        print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
