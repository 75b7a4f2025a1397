"""scripts/setup_env.sh and scripts/torch_source.py: which torch the set-up installs on which machine, and
what the main job and the tests each install, checked without downloading anything.

``decide`` is tested for every case; the CLI on this machine (a real torch present, none present, a fake
``nvidia-smi`` on PATH, an explicit index). The shell script runs against a stand-in ``python`` in a
throwaway venv folder that records the pip commands it would run (everything else is the real script),
so the extras, the torch source, the DeepSpeed line, the constraints and the idempotent marker are all
checked in ~2 s.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import torch_source

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "torch_source.py"
CPU = torch_source.CPU_INDEX_URL


def never_called():
    raise AssertionError("the CPU index must not be probed in this case")


def test_release_and_bound():
    assert torch_source.release("2.13.0+cpu") == (2, 13, 0)
    assert torch_source.release("2.5.0rc1") == (2, 5, 0)
    assert torch_source.satisfies("2.4")
    assert torch_source.satisfies("2.4.0+cu121")
    assert torch_source.satisfies("2.13.0+cpu")
    assert not torch_source.satisfies("2.3.1")
    assert not torch_source.satisfies("1.13.1+cu117")


def test_bound_matches_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if re.match(r"torch\b", d)]
    assert torch_dep == "torch>=" + ".".join(map(str, torch_source.TORCH_MIN))


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("override", [None, "cpu", "https://example.invalid/whl/cu121"])
def test_satisfying_torch_is_kept(gpu, override):
    plan = torch_source.decide("2.13.0+cpu", gpu, override, never_called)
    assert (plan.action, plan.line()) == ("keep", "keep")


def test_no_gpu_picks_cpu_index():
    plan = torch_source.decide(None, False, None, lambda: True)
    assert plan.line() == f"install {CPU}"
    # an old torch is replaced the same way
    assert torch_source.decide("2.1.0", False, None, lambda: True).line() == f"install {CPU}"


def test_no_gpu_unreachable_cpu_index_falls_back_to_pip_config():
    plan = torch_source.decide(None, False, None, lambda: False)
    assert plan.line() == "install default"
    assert "cannot be reached" in plan.reason


def test_gpu_picks_default_cuda_build():
    plan = torch_source.decide(None, True, None, never_called)
    assert plan.line() == "install default"
    assert "CUDA" in plan.reason


@pytest.mark.parametrize("gpu", [False, True])
def test_override(gpu):
    assert torch_source.decide(None, gpu, "cpu", never_called).line() == f"install {CPU}"
    assert torch_source.decide(None, gpu, "default", never_called).line() == "install default"
    url = "https://download.pytorch.org/whl/cu126"
    assert torch_source.decide("2.0.1", gpu, url, never_called).line() == f"install {url}"


def _fake_nvidia_smi(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    smi = folder / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    return folder


def test_cli_on_this_machine(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}
    run = lambda *args, **kw: subprocess.run([sys.executable, *args, str(SCRIPT)], capture_output=True, text=True,
                                             check=True, **kw).stdout.strip()
    # this interpreter has torch: kept
    assert run(env=env) == "keep"
    # -S hides site-packages, i.e. an interpreter without torch; a GPU on PATH -> the default (CUDA) build
    gpu_env = env | {"PATH": f"{_fake_nvidia_smi(tmp_path / 'bin')}{os.pathsep}{env['PATH']}"}
    assert run("-S", env=gpu_env) == "install default"
    assert run("-S", env=env | {"TORCH_INDEX_URL": "cpu"}) == f"install {CPU}"


# --------------------------------------------------------------------------------------------------
# The shell script, with a stand-in python that records pip commands
# --------------------------------------------------------------------------------------------------
FAKE_PYTHON = """#!/bin/sh
# stand-in for $VENV/bin/python: records pip commands, answers the torch version, runs torch_source.py
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  shift 2; [ "$1" = --disable-pip-version-check ] && shift; echo "pip $*" >> "$LOG"
  case "$*" in *"torch=="*) echo "2.13.0+cpu" > "$STATE" ;; esac
  case "$*" in *"-c "*) cp "$(echo "$*" | sed 's/.*-c \\([^ ]*\\).*/\\1/')" "$CONSTRAINTS_COPY" ;; esac
  exit 0
fi
if [ "$1" = "-c" ]; then
  [ -f "$STATE" ] && cat "$STATE" && exit 0
  exit 1
fi
case "$1" in *torch_source.py)
  if [ -f "$STATE" ]; then exec "$REAL_PYTHON" "$@"; else exec "$REAL_PYTHON" -S "$@"; fi ;;
esac
echo "unexpected: $*" >&2; exit 3
"""


@pytest.fixture()
def fake_venv(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX_URL", "DS_BUILD_OPS")}
    env.update(VENV=str(venv), LOG=str(tmp_path / "pip.log"), STATE=str(tmp_path / "torch-version"),
               CONSTRAINTS_COPY=str(tmp_path / "constraints.used"), REAL_PYTHON=sys.executable,
               PATH=f"{_fake_nvidia_smi(tmp_path / 'gpu')}{os.pathsep}{env['PATH']}")

    def run(*args: str, **extra: str) -> list[str]:
        log = tmp_path / "pip.log"
        log.unlink(missing_ok=True)
        subprocess.run(["bash", str(ROOT / "scripts" / "setup_env.sh"), *args], env=env | extra, check=True,
                       capture_output=True, text=True)
        return log.read_text().splitlines() if log.exists() else []

    return run, tmp_path


def test_setup_script_installs_by_role_and_is_idempotent(fake_venv):
    run, tmp = fake_venv
    pins = dict(re.findall(r"^(torch|deepspeed)==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M))
    # main job on a GPU machine without torch: CUDA build from the default index, DeepSpeed as its docs
    # say (after torch, plain pip), the project with no extra, under the constraints
    cmds = run()
    assert f"pip install -q torch=={pins['torch']}" in cmds
    assert f"pip install -q deepspeed=={pins['deepspeed']}" in cmds
    (proj,) = [c for c in cmds if " -e " in c]
    assert proj.endswith("-e .") and f"-c {tmp / 'venv' / 'constraints.txt'}" in proj
    used = (tmp / "constraints.used").read_text().splitlines()
    assert "torch==2.13.0+cpu" in used and used.count("torch==2.13.0+cpu") == 1
    assert not any(line.startswith("torch==") and line != "torch==2.13.0+cpu" for line in used)
    # again: nothing to do; the test extra then installs only what is missing, torch kept
    assert run() == []
    cmds = run("--extras", "test")
    assert not any("torch==" in c for c in cmds)
    assert any(c.endswith("-e .[test]") for c in cmds)
    assert run("--extras", "test") == [] and run() == []  # the runtime is a subset of what is installed


def test_setup_script_torch_source_override_and_prebuilt_ops(fake_venv):
    run, _ = fake_venv
    # explicit CPU index; DS_BUILD_OPS=1 (pre-compiled ops) builds DeepSpeed against the installed torch
    cmds = run("--torch-index-url", "cpu", DS_BUILD_OPS="1", DEEPSPEED_VERSION="0.19.8")
    assert any(c.startswith("pip install -q --index-url https://download.pytorch.org/whl/cpu torch==") for c in cmds)
    assert "pip install -q --no-build-isolation deepspeed==0.19.8" in cmds


def test_test_command_installs_test_only_packages_and_main_job_does_not():
    main = (ROOT / "scripts" / "run_main.sh").read_text()
    test = (ROOT / "scripts" / "test.sh").read_text()
    assert "apt-get" not in main and "redis" not in main and "--extras" not in main
    assert "--extras test" in test and "apt-get" not in test  # no system packages at all since Redis dedup retired
    assert "apt-get" not in (ROOT / "scripts" / "setup_env.sh").read_text()


def test_every_installed_distribution_is_pinned_in_constraints():
    """constraints.txt is the freeze of the CI venv: each distribution the test venv holds (the tracking extra's
    tensorboard/grpcio/Markdown/Werkzeug tree and ruff included; issue 29) has its pin there."""
    import re
    from importlib.metadata import distributions
    from pathlib import Path

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    root = Path(__file__).resolve().parents[2]
    pinned = {norm(line.split("==")[0]) for line in (root / "constraints.txt").read_text().splitlines()
              if line and not line.startswith("#")}
    skip = {"pip", "setuptools", "wheel", "megatron-ds-suite"}  # the installer's own, and the project itself
    installed = {norm(d.metadata["Name"]) for d in distributions() if d.metadata["Name"]}
    # a CUDA build of torch (kept by setup_env on a GPU machine) brings its own runtime wheels
    cuda_runtime = {n for n in installed if n.startswith(("nvidia-", "cuda-", "triton"))}
    assert installed - pinned - skip - cuda_runtime == set()
