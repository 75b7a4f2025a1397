"""``--overwrite`` never destroys what it should not (issue 30 item 2): a tool that replaces a folder takes its
run lock (a live training run there is refused and left intact), and an output that is its own input, holds
it or lies inside it is refused in one line before any work."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256), the lock file aside."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def _one_line(capsys) -> str:
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture()
def live_run(random_gpt2, tmp_path):
    """A copy of an imported run with a metrics.jsonl, held by a training-run lock in another process."""
    _, run = random_gpt2
    live = tmp_path / "live"
    shutil.copytree(run, live)
    (live / "metrics.jsonl").write_text('{"iteration": 1, "loss": 10.9}\n{"iteration": 2, "loss": 10.7}\n')
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from training.runtime.run_lock import RunDirLock
        RunDirLock({str(live)!r}).acquire()
        print("locked", flush=True)
        time.sleep(300)""")], env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield live, holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_import_overwrite_onto_a_live_run_is_refused_and_leaves_it_intact(random_gpt2, live_run, tmp_path, capsys):
    from training.tools.import_hf import main

    src, _ = random_gpt2
    live, pid = live_run
    before = _snapshot(live)
    assert main(["--model", str(src), "--out", str(live), "--overwrite"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"error: --out {live} is in use by another training run (pid {pid} on "), line
    assert _snapshot(live) == before and "metrics.jsonl" in before
    assert not list(tmp_path.glob(".live.tmp-*"))  # refused before any work: no temporary import beside it
    # the same folder once no run holds it: replaced, and the lock the import took is released
    quiet = tmp_path / "quiet"
    shutil.copytree(live, quiet)
    assert main(["--model", str(src), "--out", str(quiet), "--overwrite"]) == 0
    assert not (quiet / "metrics.jsonl").exists() and (quiet / "checkpoints" / "latest").is_file()


def test_export_onto_a_live_run_is_refused(live_run, tmp_path, capsys):
    from training.tools.export_hf import main

    live, pid = live_run
    before = _snapshot(live)
    other = tmp_path / "other_run"
    shutil.copytree(live, other)
    assert main(["--checkpoint", str(other), "--out", str(live), "--overwrite"]) == 2
    assert f"--out {live} is in use by another training run (pid {pid} on " in _one_line(capsys)
    assert _snapshot(live) == before


@pytest.mark.parametrize("where", ["itself", "parent", "inside"])
def test_export_onto_its_own_checkpoint_run_is_refused(random_gpt2, tmp_path, capsys, where):
    from training.tools.export_hf import main

    _, imported = random_gpt2
    run = tmp_path / "runs" / "r"
    shutil.copytree(imported, run)
    before = _snapshot(tmp_path)
    out = {"itself": run, "parent": run.parent, "inside": run / "hf"}[where]
    assert main(["--checkpoint", str(run), "--out", str(out), "--overwrite"]) == 2
    reason = {"itself": "is --checkpoint itself", "parent": f"contains --checkpoint {run}",
              "inside": f"lies inside --checkpoint {run}"}[where]
    assert _one_line(capsys) == (f"error: --out {out} {reason}: the export would replace the run it reads; choose "
                                 f"an --out outside it")
    assert _snapshot(tmp_path) == before and not (run / "hf").exists()


def test_import_onto_its_own_model_folder_is_refused(random_gpt2, tmp_path, capsys):
    from training.tools.import_hf import main

    src, _ = random_gpt2
    model = tmp_path / "hf"
    shutil.copytree(src, model)
    link = tmp_path / "link"
    link.symlink_to(model)  # the same folder under another name
    before = _snapshot(model)
    assert main(["--model", str(model), "--out", str(link), "--overwrite"]) == 2
    assert _one_line(capsys) == (f"error: --out {link} is --model itself: the import would replace the model it "
                                 f"reads; choose an --out outside it")
    assert _snapshot(model) == before


def test_reshard_into_its_own_run_is_refused(random_gpt2, tmp_path, capsys):
    from training.tools.reshard import main

    _, imported = random_gpt2
    run = tmp_path / "r"
    shutil.copytree(imported, run)
    before = _snapshot(run)
    assert main(["--checkpoint", str(run), "--tp", "1", "--out", str(run / "tp1")]) == 2
    assert f"--out {run / 'tp1'} lies inside --checkpoint {run}: choose a new directory outside it" in _one_line(capsys)
    assert _snapshot(run) == before and not (run / "tp1").exists()


@pytest.mark.parametrize("where", ["inside", "parent", "link_inside"])
def test_init_from_refuses_a_run_dir_around_or_inside_its_source(tmp_path, where):
    """``train.init_from`` refused only ``run.dir`` equal to the source: a run.dir inside the source wrote the new
    run's checkpoints into it, and one holding it put the source inside the new run. Checked before any read."""
    from training.config import ConfigError, load_config
    from training.resolve import adopt_model_config

    src = tmp_path / "runs" / "src"
    src.mkdir(parents=True)
    (tmp_path / "link").symlink_to(src)
    run_dir = {"inside": src / "next", "parent": src.parent, "link_inside": tmp_path / "link" / "next"}[where]
    cfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", [f"run.dir={run_dir}", f"train.init_from={src}"])
    reason = f"contains train.init_from {src}" if where == "parent" else f"lies inside train.init_from {src}"
    with pytest.raises(ConfigError, match=f"run.dir={run_dir} {reason}: the new run would write into or around"):
        adopt_model_config(cfg)
    assert list(src.iterdir()) == []


@pytest.mark.parametrize("where", ["inside", "parent"])
def test_finetune_refuses_a_run_dir_around_or_inside_the_pretrained_run(tmp_path, where):
    from training.config import ConfigError
    from training.finetune_race import load_finetune_config

    pre = tmp_path / "runs" / "bert"
    pre.mkdir(parents=True)
    run_dir = {"inside": pre / "race", "parent": pre.parent}[where]
    reason = f"contains finetune.pretrained {pre}" if where == "parent" else f"lies inside finetune.pretrained {pre}"
    with pytest.raises(ConfigError, match=f"run.dir={run_dir} {reason}"):
        load_finetune_config(ROOT / "configs" / "race.yaml", [f"finetune.pretrained={pre}", f"run.dir={run_dir}"])
    with pytest.raises(ConfigError, match="is the pretrained run"):  # the same folder: its own message, as before
        load_finetune_config(ROOT / "configs" / "race.yaml", [f"finetune.pretrained={pre}", f"run.dir={pre}"])
