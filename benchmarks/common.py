"""Shared timing helpers for the benchmarks: interleaved repetitions, median and spread, machine info.

These machines are shared and noisy, so a comparison is never two separate runs: every candidate is
timed once per repetition, in a rotating order (A B, B A, A B, ...), and the report gives the median
and the min-max spread over repetitions, plus the load average before and after the run.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Samples:
    """Values of one measured quantity over repetitions (e.g. seconds per step)."""

    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)

    def fmt(self, spec: str = ".3f", scale: float = 1.0) -> str:
        """'median [min-max]' with each value multiplied by ``scale``."""
        return (f"{format(self.median * scale, spec)} [{format(self.lo * scale, spec)}"
                f"-{format(self.hi * scale, spec)}]")


def interleaved(candidates: dict[str, Callable[[], float]], reps: int, progress: bool = True) -> dict[str, Samples]:
    """Run each candidate ``reps`` times, rotating the order every repetition.

    Each callable returns its own measurement (seconds, or any number); the rotation spreads slow
    drifts of the machine (another job starting, thermal state) over all candidates alike.
    """
    from tqdm import tqdm

    names = list(candidates)
    out = {n: Samples() for n in names}
    for r in tqdm(range(reps), desc="repetitions", leave=False, disable=not progress):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            out[n].values.append(candidates[n]())
    return out


def ratio_samples(num: Samples, den: Samples) -> Samples:
    """Per-repetition ratios num[i] / den[i] (same repetition = same machine conditions)."""
    return Samples([a / b for a, b in zip(num.values, den.values)])


def timed(fn: Callable[[], object], n: int = 1) -> float:
    """Seconds per call of ``fn`` over ``n`` back-to-back calls."""
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


class CpuClock:
    """Wraps a timed callable to also record, per call, this process's CPU seconds (user + system, all
    threads), its system seconds and its minor page faults (``getrusage``): on an oversubscribed machine
    wall time includes waiting for a core, CPU time does not (though it does include OpenMP threads
    spinning at barriers); system time and page faults show the cost of first-touching fresh memory."""

    def __init__(self, fn: Callable[[], float], n: int = 1):
        self.fn, self.n = fn, n
        self.cpu, self.sys, self.faults = Samples(), Samples(), Samples()

    def __call__(self) -> float:
        import resource

        r0 = resource.getrusage(resource.RUSAGE_SELF)
        wall = self.fn()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu.values.append((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / self.n)
        self.sys.values.append((r1.ru_stime - r0.ru_stime) / self.n)
        self.faults.values.append((r1.ru_minflt - r0.ru_minflt) / self.n)
        return wall


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        return "n/a"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return platform.processor() or "unknown"


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "not installed"


def gpu_info() -> dict[str, str]:
    """GPU name, memory, driver and CUDA versions (the driver from nvidia-smi when it is on PATH)."""
    import torch

    prop = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                                capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown (nvidia-smi not available)"
    return {"gpu": f"{prop.name}, {prop.total_memory / 2**30:.1f} GiB, {prop.multi_processor_count} SMs",
            "driver": driver, "cuda (torch build)": str(torch.version.cuda),
            "cudnn": str(torch.backends.cudnn.version())}


def machine_info(gpu: bool = False) -> dict[str, str]:
    """Facts that go next to every figure: date, machine, software, load (and the GPU when ``gpu``)."""
    import torch

    info = {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": f"{cpu_model()}, {os.cpu_count()} logical cores",
        "torch": f"{torch.__version__}, {torch.get_num_threads()} intra-op threads",
        "deepspeed / transformers": f"{_version('deepspeed')} / {_version('transformers')}",
        "python": platform.python_version(),
        "git": git_revision(),
        "load average (1/5/15 min)": load_average(),
    }
    if gpu:
        info.update(gpu_info())
    return info


def gpu_matmul_tflops(dtype: str, n: int = 8192, reps: int = 10) -> float:
    """TFLOP/s of an n x n x n matmul on GPU 0 (mean of ``reps`` after a warm-up, timed with CUDA events)."""
    import torch

    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a = torch.randn(n, n, device="cuda", dtype=tdt)
    b = torch.randn(n, n, device="cuda", dtype=tdt)
    torch.matmul(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        torch.matmul(a, b)
    end.record()
    end.synchronize()
    return 2.0 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def with_peak_gpu_memory(fn: Callable[[], float], out: Samples) -> Callable[[], float]:
    """Wraps a timed callable to also record, per call, the peak GPU memory allocated during it above
    what was allocated when it started (bytes): the call's own activations and temporaries, whatever
    else (other models) sits on the GPU meanwhile."""
    import torch

    def call() -> float:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        value = fn()
        torch.cuda.synchronize()
        out.values.append(float(torch.cuda.max_memory_allocated() - base))
        return value

    return call


def command_line() -> str:
    """The command that produced the figures, as it can be pasted back (``-m benchmarks.NAME`` when run as a
    module, else the repo-relative script path)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["-m", spec.name] if spec is not None and spec.name else [os.path.relpath(sys.argv[0], ROOT)]
    return ".venv/bin/python " + " ".join(shlex.quote(a) for a in [*head, *sys.argv[1:]])


def markdown_header(info: dict[str, str], load_after: str | None = None) -> str:
    lines = [f"Command: `{command_line()}`", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    if load_after is not None:
        lines.append(f"- load average after the run: {load_after}")
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def init_single_process(device: str) -> None:
    """World of one process (gloo on CPU, NCCL on a GPU): DeepSpeed's engine and our ParallelState
    need torch.distributed."""
    import torch

    from megatron_ds_suite.core.network import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_SIZE="1")
    from training.runtime.distributed import init_distributed

    if device == "cuda":
        torch.cuda.set_device(0)
    init_distributed("nccl" if device == "cuda" else "gloo")


def tp_gpt2_engine(a: dict, world: int) -> tuple[Any, Any, Any]:
    """(engine, tokens, labels): a TP = ``world`` GPT-2 (``a``: layers, hidden, heads, seq, vocab, padded,
    batch, optional dropout, optional device 'cpu'/'cuda' and dtype, default cpu fp32) under
    the project's engine (``training.optim.engine.build_engine``) with its optimizer and schedule as training picks them for that device
    and dtype (``training.optim.adamw.build_optimizer``: torch's fused AdamW), DP = 1, and one
    fixed random batch on the engine's device. Called inside a process with a default process group."""
    import torch

    from training.config import Config
    from training.ds_json import deepspeed_config
    from training.models.config import ModelConfig
    from training.models.gpt2 import GPTModel
    from training.optim.adamw import build_optimizer
    from training.optim.engine import build_engine
    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState

    cfg = Config()
    dropout = {"hidden_dropout": a["dropout"], "attention_dropout": a["dropout"]} if "dropout" in a else {}
    cfg.model = ModelConfig(num_layers=a["layers"], hidden_size=a["hidden"], num_attention_heads=a["heads"],
                            seq_length=a["seq"], vocab_size=a["vocab"], **dropout)
    cfg.train.micro_batch_size = cfg.train.global_batch_size = a["batch"]
    dtype = a.get("dtype", "fp32")
    cfg.precision.dtype = dtype
    ps = ParallelState(tp=world)
    tp_random.configure(ps, cfg.model.num_layers)
    tp_random.set_seed(cfg.train.seed)
    model = GPTModel(cfg.model, a["padded"], ps.tp_group, seed=cfg.train.seed).train()
    opt, sched = build_optimizer(model, cfg.optimizer, 10**6)
    engine = build_engine(model, opt, sched, deepspeed_config(cfg, 1, dtype), ps)
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, a["vocab"], (a["batch"], a["seq"] + 1), generator=gen).to(engine.device)
    return engine, seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
