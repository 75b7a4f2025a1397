"""Where scripts/setup_env.sh gets torch from: keep the one installed, or pick the wheel index by machine.

A bare ``pip install torch`` on Linux pulls the CUDA build (several GB), which a CPU machine does not
want, and reinstalling torch on a GPU machine that already has a working build is worse. So:

1. a torch already installed that satisfies the project's bound (``torch>=2.4``) is kept, whatever its
   build (a CPU torch on a GPU machine included: remove it first to switch);
2. otherwise an explicit choice wins: ``TORCH_INDEX_URL`` / ``--torch-index-url`` (``cpu`` = PyTorch's
   CPU index, ``default`` = pip's own configuration, anything else = an index URL);
3. otherwise a machine with an NVIDIA GPU gets pip's default index (PyPI's Linux torch is the CUDA
   build), and one without gets PyTorch's CPU wheel index, which is probed first: where it cannot be
   reached (an offline machine with a local wheel in pip's find-links, a proxy that only serves PyPI)
   the set-up falls back to pip's own configuration and says so.

Stdlib only (it runs before anything is installed). ``decide`` is the whole policy, a pure function;
``tests/e2e/test_setup_env.py`` checks every case without downloading anything.

    python scripts/torch_source.py [--torch-index-url URL|cpu|default]
    # prints one line: "keep", "install default" or "install URL"; the reason goes to stderr
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

CPU_INDEX_URL = "https://download.pytorch.org/whl/cpu"
# The project's lower bound on torch (pyproject.toml: "torch>=2.4"; tests/e2e/test_setup_env.py keeps the two equal).
TORCH_MIN = (2, 4)


@dataclass(frozen=True)
class TorchPlan:
    """What the set-up does about torch."""

    action: str  # "keep" | "install"
    index_url: Optional[str]  # None = pip's own configuration (PyPI plus any configured find-links)
    reason: str

    def line(self) -> str:
        """The one line the shell script reads."""
        if self.action == "keep":
            return "keep"
        return f"install {self.index_url or 'default'}"


def release(version: str) -> tuple[int, ...]:
    """Numeric release of a PEP 440 version: '2.13.0+cpu' -> (2, 13, 0); '2.5.0rc1' -> (2, 5, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(x) for x in m.group(1).split("."))


def satisfies(version: str, minimum: tuple[int, ...] = TORCH_MIN) -> bool:
    """Whether an installed torch ``version`` meets the project's lower bound."""
    rel = release(version)
    n = max(len(rel), len(minimum))
    return rel + (0,) * (n - len(rel)) >= minimum + (0,) * (n - len(minimum))


def decide(installed: Optional[str], has_nvidia_gpu: bool, override: Optional[str],
           cpu_index_reachable: Callable[[], bool]) -> TorchPlan:
    """The policy (module docstring). ``installed``: the torch version in the target environment or None;
    ``override``: TORCH_INDEX_URL or the flag ('' or None = none); ``cpu_index_reachable`` is called only
    when the automatic choice is the CPU index."""
    if installed is not None and satisfies(installed):
        return TorchPlan("keep", None, f"torch {installed} is installed and satisfies torch>="
                                       f"{'.'.join(map(str, TORCH_MIN))}: kept")
    why = (f"torch {installed} is older than {'.'.join(map(str, TORCH_MIN))}" if installed is not None
           else "no torch installed")
    if override:
        if override == "default":
            return TorchPlan("install", None, f"{why}; TORCH_INDEX_URL=default: pip's own configuration")
        url = CPU_INDEX_URL if override == "cpu" else override
        return TorchPlan("install", url, f"{why}; TORCH_INDEX_URL: {url}")
    if has_nvidia_gpu:
        return TorchPlan("install", None, f"{why}; NVIDIA GPU found: the default (CUDA) build from PyPI")
    if cpu_index_reachable():
        return TorchPlan("install", CPU_INDEX_URL, f"{why}; no NVIDIA GPU: the CPU build from {CPU_INDEX_URL}")
    return TorchPlan("install", None, f"{why}; no NVIDIA GPU, but {CPU_INDEX_URL} cannot be reached: pip's own "
                                      f"configuration (a local CPU wheel in find-links, or PyPI's default build); "
                                      f"set TORCH_INDEX_URL to choose")


# --------------------------------------------------------------------------------------------------
# Probes of the real machine (the inputs of ``decide``)
# --------------------------------------------------------------------------------------------------
def installed_torch() -> Optional[str]:
    """Version of the torch distribution visible to this interpreter, without importing torch (fast)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def nvidia_gpu_present() -> bool:
    """An NVIDIA GPU with a working driver: ``nvidia-smi -L`` lists one (or the driver's /proc entries exist)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and "GPU" in out.stdout:
                return True
        except (OSError, subprocess.SubprocessError):
            pass
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def url_reachable(url: str, timeout: float = 8.0) -> bool:
    """Whether an index answers at all (any HTTP status counts; DNS/connection failures do not)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--torch-index-url", default=os.environ.get("TORCH_INDEX_URL", ""),
                   help="cpu, default, or an index URL (default: $TORCH_INDEX_URL, else chosen by the machine)")
    args = p.parse_args(argv)
    plan = decide(installed_torch(), nvidia_gpu_present(), args.torch_index_url or None,
                  lambda: url_reachable(CPU_INDEX_URL + "/"))
    print(f"setup_env: {plan.reason}", file=sys.stderr)
    print(plan.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
