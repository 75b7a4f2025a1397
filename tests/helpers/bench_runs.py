"""bench_train_step runs for tests/e2e/test_benchmarks.py: the tiny argvs and the one-rank workers that run them."""
from __future__ import annotations

import contextlib
import io

TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "300"]
ONE_STEP = ["--reps", "1", "--steps", "1", "--warmup", "1"]
# every bench_train_step run of test_benchmarks.py, made by one one-rank launch (the launch, not the tiny run, is what
# costs): fp32 first, then fp16 and bf16, the compiled layers last (dynamo's caches stay in the process)
BENCH_RUNS = {
    "fp32": TINY + ONE_STEP + ["--dtype", "fp32", "--engine-default"],
    "llama": ["--model", "llama", "--layers", "1", "--hidden", "32", "--heads", "4", "--kv-groups", "2", "--seq", "16",
              "--batch", "2", "--vocab", "300", *ONE_STEP, "--counts", "1"],
    "fp16": TINY + ONE_STEP + ["--dtype", "fp16", "--engine-default"],
    "step_ab": TINY + ONE_STEP + ["--dtype", "fp16", "--only", "ours", "--step-ab", "--counts", "1"],
    "dtype_ab": TINY + ONE_STEP + ["--dtype", "bf16", "--dtype-ab", "fp16", "--step-ab", "--only", "ours", "--counts",
                                   "1", "--json"],  # + the JSON's path
    "profile": TINY + ["--dtype", "fp16", "--only", "ours", "--profile", "2", "--profile-rows", "5"],
    "compile": TINY + ONE_STEP + ["--compile", "--only", "ours", "--counts", "1"],
}


def bench_worker(rank, world, argv):
    """One-rank worker: what bench_train_step.main(``argv``) prints."""
    from benchmarks import bench_train_step

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench_train_step.main(argv)
    return out.getvalue()


def bench_all(rank, world, runs, timed_steps):
    """One-rank worker: {name: printed report} of each bench_train_step argv of ``runs``, in order, and the
    (seconds, steps, skipped) of ``timed_steps`` applied fp16 steps timed without warm-up (before the compiled
    run: ``runs``' last)."""
    texts = {name: bench_worker(rank, world, argv) for name, argv in runs.items() if name != "compile"}
    timed = timed_applied_worker(rank, world, timed_steps)
    texts["compile"] = bench_worker(rank, world, runs["compile"])
    return texts, timed


def timed_applied_worker(rank, world, steps):
    """(seconds, engine steps, skipped steps) of ``steps`` applied fp16 steps of a fresh runner, timed without warm-up."""
    import torch

    from benchmarks import bench_train_step
    from training.resolve import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    args = bench_train_step.parse_args(["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "2",
                                        "--vocab", "300", "--dtype", "fp16", "--only", "ours"])
    seq = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    runner = bench_train_step.build_runners(args, bench_train_step.project_config(args), 384,
                                            seq[:, :-1].contiguous(), seq[:, 1:].contiguous())["ours"]
    seconds = runner.timed_applied(steps)  # no warm-up: from 2^32 the first steps overflow and are skipped
    return seconds, int(runner.engine.global_steps), int(runner.engine.skipped_steps)
