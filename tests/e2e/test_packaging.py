"""The installable package: bundled configs, console commands, declared imports, no side effects at import,
the DeepSpeed version check, and (slow) a built wheel installed into a clean venv."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_bundled_configs_lookup(tmp_path, monkeypatch):
    from megatron_ds_suite.configs_lookup import bundled_config, find_config, list_configs

    names = list_configs()
    on_disk = sorted(p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml"))
    assert names == on_disk and "gpt2_tiny.yaml" in names and "data/default.yaml" in names
    for spelling in ("gpt2_tiny", "gpt2_tiny.yaml", "configs/gpt2_tiny.yaml"):
        assert bundled_config(spelling).read_text() == (ROOT / "configs" / "gpt2_tiny.yaml").read_text()
    assert bundled_config("no_such_config") is None and bundled_config("../pyproject.toml") is None
    # an existing file wins over a bundled one of the same name
    mine = tmp_path / "gpt2_tiny.yaml"
    mine.write_text("model: {num_layers: 3}\n")
    monkeypatch.chdir(tmp_path)
    assert find_config("gpt2_tiny.yaml") == Path("gpt2_tiny.yaml")
    assert find_config("data/default.yaml") == bundled_config("data/default.yaml")


def test_config_loaders_read_bundled_configs_from_anywhere(tmp_path, monkeypatch):
    from data_pipeline.config import load_config as load_data_config
    from training.config import ConfigError, load_config

    monkeypatch.chdir(tmp_path)  # no configs/ here
    cfg = load_config("gpt2_tiny", ["train.iters=7"])
    assert cfg.model.num_layers == 2 and cfg.train.iters == 7 and cfg.parallel.tensor == 2
    data = load_data_config("data/default.yaml")
    assert data.resolve(data.output_dir) == Path("runs/corpus-default")  # relative to the working directory
    with pytest.raises(ConfigError, match="megatron-ds-configs list"):
        load_config("nope.yaml")


def test_console_scripts_point_at_real_entry_points():
    import importlib

    scripts = PYPROJECT["project"]["scripts"]
    assert {"megatron-ds-data", "megatron-ds-pretrain", "megatron-ds-eval", "megatron-ds-finetune-race",
            "megatron-ds-export-hf", "megatron-ds-reshard", "megatron-ds-plan", "megatron-ds-configs"} <= set(scripts)
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))


def test_configs_command(capsys, tmp_path):
    from megatron_ds_suite.app.console import configs

    with pytest.raises(SystemExit) as e:
        configs(["list"])
    assert e.value.code == 0 and "gpt2_tiny.yaml" in capsys.readouterr().out.splitlines()
    with pytest.raises(SystemExit) as e:
        configs(["copy", "race", str(tmp_path / "race.yaml")])
    assert (tmp_path / "race.yaml").read_text() == (ROOT / "configs" / "race.yaml").read_text()
    # an existing (perhaps edited) copy is kept unless --force; a folder takes the config's own name
    (tmp_path / "race.yaml").write_text("# my edits\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        configs(["copy", "race", str(tmp_path / "race.yaml")])
    assert e.value.code == 2 and (tmp_path / "race.yaml").read_text() == "# my edits\n"
    assert capsys.readouterr().err.strip().endswith("pass --force to replace it")
    with pytest.raises(SystemExit) as e:
        configs(["copy", "race", str(tmp_path / "race.yaml"), "--force"])
    assert e.value.code == 0 and (tmp_path / "race.yaml").read_text() == (ROOT / "configs" / "race.yaml").read_text()
    (tmp_path / "mine").mkdir()
    with pytest.raises(SystemExit) as e:
        configs(["copy", "gpt2_tiny", str(tmp_path / "mine")])
    assert e.value.code == 0 and (tmp_path / "mine" / "gpt2_tiny.yaml").is_file()
    with pytest.raises(SystemExit) as e:
        configs(["copy", "gpt2_tiny", str(tmp_path / "no" / "such" / "x.yaml")])
    assert e.value.code == 2 and "does not exist: create it first" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        configs(["show", "nope"])
    assert e.value.code == 2 and "megatron-ds-configs list" in capsys.readouterr().err


def test_no_side_effects_at_import():
    """Importing the packages leaves the environment alone; the entry points set THP_MEM_ALLOC_ENABLE."""
    code = ("import os; before = dict(os.environ)\n"
            "import training, evaluation, data_pipeline, megatron_ds_suite, megatron_ds_suite.app.console\n"
            "import training.config, training.tracking, training.metrics, training.pretrain, training.plan\n"
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())\n"
            "from training.runtime.process_env import configure; configure()\n"
            "print(os.environ['THP_MEM_ALLOC_ENABLE'])")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    out = subprocess.run([sys.executable, "-c", code], env=env | {"THP_MEM_ALLOC_ENABLE": "0"}, capture_output=True,
                         text=True, cwd=ROOT)
    assert out.stdout.strip() == "0"  # an explicit value wins


def test_every_third_party_import_is_declared():
    """Each top-level third-party module imported by the package is a declared dependency (runtime or an extra)."""
    import ast

    declared = " ".join(PYPROJECT["project"]["dependencies"]
                        + sum(PYPROJECT["project"]["optional-dependencies"].values(), [])).lower()
    dist_of = {"yaml": "pyyaml", "lm_eval": "lm-eval"}
    local = {"data_pipeline", "training", "evaluation", "megatron_ds_suite", "tests"}
    missing = set()
    for pkg in ("data_pipeline", "training", "evaluation", "megatron_ds_suite"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                         else [])
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in local or top == "__future__":
                        continue
                    if not re.search(rf"(^|[\s\"]){re.escape(dist_of.get(top, top))}[\[<>=;,\s]", declared):
                        missing.add(f"{top} ({path.relative_to(ROOT)})")
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"


def test_deepspeed_version_check():
    import deepspeed

    from training.optim.engine import untested_deepspeed

    assert untested_deepspeed("0.19.8") is None and untested_deepspeed("0.19.0") is None
    for bad in ("0.18.9", "0.20.0", "1.0.0"):
        msg = untested_deepspeed(bad)
        assert msg and "\n" not in msg and bad in msg and "tested: 0.19.x" in msg
    assert untested_deepspeed(deepspeed.__version__) is None  # the installed one is the tested one
    dep = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("deepspeed")]
    assert dep == ["deepspeed>=0.19,<0.20"]


@pytest.mark.slow
def test_wheel_installs_with_console_commands_and_configs(tmp_path):
    """Build the wheel, install it (no dependencies) into a clean venv that sees this environment's torch and
    DeepSpeed through a .pth file, and run the commands from outside the checkout."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", ".whl*"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(pip + ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("megatron_ds_suite-*.whl")
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "megatron_ds_suite/configs/gpt2_tiny.yaml" in names and "megatron_ds_suite/configs/data/default.yaml" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "zz_deps.pth").write_text("\n".join(deps) + "\n")  # torch, DeepSpeed & co. from this environment
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"DS_ACCELERATOR": "cpu"}
    run = lambda *cmd: subprocess.run([str(venv / "bin" / cmd[0]), *cmd[1:]], cwd=work, env=env, capture_output=True,
                                      text=True, timeout=300)
    where = subprocess.run([str(py), "-c", "import training, megatron_ds_suite; print(training.__file__)"], cwd=work,
                           env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where  # the installed copy, not the checkout
    cmds = ("megatron-ds-data", "megatron-ds-pretrain", "megatron-ds-finetune-race", "megatron-ds-eval",
            "megatron-ds-export-hf", "megatron-ds-reshard", "megatron-ds-plan")
    procs = {cmd: subprocess.Popen([str(venv / "bin" / cmd), "--help"], cwd=work, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for cmd in cmds}  # all at once: imports dominate
    for cmd, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "usage:" in out, (cmd, err[-2000:])
        assert out.startswith(f"usage: {cmd} "), (cmd, out[:200])  # the command that was typed, not python -m
    out = run("megatron-ds-configs", "show", "gpt2_tiny")
    assert out.returncode == 0 and out.stdout == (ROOT / "configs" / "gpt2_tiny.yaml").read_text()
    out = run("megatron-ds-plan", "--config", "gpt2_1.2b.yaml", "--tp", "8", "--dp", "1", "--gpu", "v100")
    assert out.returncode == 0, out.stderr[-2000:]
