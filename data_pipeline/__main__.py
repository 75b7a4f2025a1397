"""Command line of the corpus builder.

    python -m data_pipeline build  --config configs/data/default.yaml [key.sub=value ...] [--force]
    python -m data_pipeline stage  dedup --config configs/data/default.yaml dedup.threshold=0.8
    python -m data_pipeline status --config configs/data/default.yaml
"""
from __future__ import annotations

import argparse
import logging
import sys

from .config import ConfigError, load_config
from .stages import STAGES, StageError, build, fingerprint, is_done, run_stage, summary_table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_pipeline", description="Build a training corpus.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="run every unfinished stage")
    b.add_argument("--force", action="store_true", help="recompute every stage")
    s = sub.add_parser("stage", help="run one stage now (its upstream stages must be finished)")
    s.add_argument("name", choices=STAGES)
    st = sub.add_parser("status", help="which stages are finished for this config")
    for a in (b, s, st):
        a.add_argument("--config", required=True, help="YAML file, e.g. configs/data/default.yaml")
        a.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. dedup.threshold=0.8")
        a.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    except (ConfigError, StageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
