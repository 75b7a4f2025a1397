"""The Hugging Face tools: ``export_hf`` onto itself, its parent, a live run or from damaged checkpoints, and
``import_hf`` of damaged, inconsistent or malicious weights and configs.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.hostile.case import case
from tests.hostile.damage import binary_file, nothing_written, plant_evil, pwned, run_intact, snap_save, truncate
from tests.hostile.fixtures import BINARY, copy_of, fixture, latest_tag_dir


def _export(ckpt: Path, out: Path, *extra: str) -> list[str]:
    return ["python", "-m", "training.tools.export_hf", "--checkpoint", str(ckpt), "--out", str(out), *extra]


@case("tools", "export_ok", "export the tiny run (control)", "ok")
def _(p, tmp):
    return _export(fixture(p, "run"), tmp / "hf")


@case("tools", "export_onto_itself", "`export_hf --checkpoint R --out R --overwrite`", check=run_intact)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    snap_save(tmp)
    return _export(run, run, "--overwrite")


@case("tools", "export_onto_parent", "`export_hf --out` the folder holding the run, `--overwrite`",
      check=run_intact)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    snap_save(tmp)
    return _export(run, tmp, "--overwrite")


@case("tools", "export_into_run", "`export_hf --out RUN/hf` inside the run")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    return _export(run, run / "hf")


@case("tools", "export_onto_live_run", "`export_hf --out LIVE --overwrite` onto a run a training process holds",
      check=run_intact)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    snap_save(tmp)
    p.hold(tmp, run)
    return _export(fixture(p, "run"), run, "--overwrite")


@case("tools", "export_out_exists", "`export_hf --out` an existing non-empty folder without --overwrite",
      check=lambda p, tmp, res: None if (tmp / "hf" / "keep.txt").is_file() else "the folder was replaced")
def _(p, tmp):
    (tmp / "hf").mkdir()
    (tmp / "hf" / "keep.txt").write_text("mine")
    return _export(fixture(p, "run"), tmp / "hf")


@case("tools", "export_missing_tp_shard", "export a TP=2 checkpoint with a shard deleted")
def _(p, tmp):
    run = copy_of(p, "run_tp2", tmp / "run")
    next((run / "checkpoints").glob("*/mp_rank_01_model_states.pt")).unlink()
    return _export(run, tmp / "hf")


@case("tools", "export_binary_latest", "export a run with a binary latest")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    (run / "checkpoints" / "latest").write_bytes(b"\x80\x81\xfe\x00")
    return _export(run, tmp / "hf")


@case("tools", "export_corpus_folder", "a corpus folder as `export_hf --checkpoint`")
def _(p, tmp):
    return _export(fixture(p, "corpus"), tmp / "hf")


@case("tools", "export_checkpoint_is_file", "`export_hf --checkpoint` a file")
def _(p, tmp):
    return _export(fixture(p, "text"), tmp / "hf")


@case("tools", "export_symlinked_tag", "export a run whose tag folder is a symlink")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    tag = latest_tag_dir(run)
    shutil.move(str(tag), tmp / "moved")
    tag.symlink_to(tmp / "moved")
    return _export(run, tmp / "hf")


@case("tools", "export_zero_byte_shard", "the model file emptied (0 bytes)")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    (latest_tag_dir(run) / "mp_rank_00_model_states.pt").write_bytes(b"")
    return _export(run, tmp / "hf")


@case("tools", "export_malicious_pickle", "export a model file whose pickle runs code", check=pwned)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    plant_evil(p, latest_tag_dir(run) / "mp_rank_00_model_states.pt", tmp / "PWNED")
    return _export(run, tmp / "hf")


def _import(model: Path, out: Path, *extra: str) -> list[str]:
    return ["python", "-m", "training.tools.import_hf", "--model", str(model), "--out", str(out), *extra]


@case("tools", "import_ok", "import the random GPT-2 at TP=1 (control)", "ok")
def _(p, tmp):
    return _import(fixture(p, "hf"), tmp / "run")


@case("tools", "import_damaged_weights", "`import_hf` of a model.safetensors cut short",
      check=lambda p, tmp, res: "a run was written" if (tmp / "run").exists() else None)
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    w = src / "model.safetensors"
    truncate(w, w.stat().st_size // 2)
    return _import(src, tmp / "run")


@case("tools", "import_garbage_weights", "`import_hf` of a model.safetensors full of junk")
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    (src / "model.safetensors").write_bytes(BINARY * 16)
    return _import(src, tmp / "run")


@case("tools", "import_binary_config", "`import_hf` of a folder whose config.json is binary")
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    binary_file(src / "config.json")
    return _import(src, tmp / "run")


@case("tools", "import_offline_hub_name", "`import_hf --model` an unknown hub name, offline")
def _(p, tmp):
    return _import(Path("no-such-org/no-such-model"), tmp / "run")


@case("tools", "import_onto_live_run", "`import_hf --out LIVE --overwrite` onto a run a training process holds",
      check=run_intact)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    snap_save(tmp)
    p.hold(tmp, run)
    return _import(fixture(p, "hf"), run, "--overwrite")


@case("tools", "import_onto_its_model", "`import_hf --out` the model folder itself, `--overwrite`",
      check=lambda p, tmp, res: None if (tmp / "hf" / "model.safetensors").is_file() else "the model was deleted")
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    return _import(src, src, "--overwrite")


@case("tools", "import_tp_not_dividing", "`import_hf --tp 3` (2 heads)")
def _(p, tmp):
    return _import(fixture(p, "hf"), tmp / "run", "--tp", "3")


def _hf_weights(src: Path, fn) -> None:
    """Edit the random GPT-2's model.safetensors in place (``fn`` gets its {name: tensor})."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(src / "model.safetensors"))
    fn(sd)
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})


def _hf_config(src: Path, **values) -> None:
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **values}))


@case("tools", "import_missing_tensor", "`import_hf` of a model.safetensors lacking one tensor (random-filled before)",
      check=nothing_written)
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    _hf_weights(src, lambda sd: sd.pop("transformer.h.0.mlp.c_fc.weight"))
    return _import(src, tmp / "run")


@case("tools", "import_config_more_layers", "`import_hf` of a config.json claiming 3 layers, weights of 1",
      check=nothing_written)
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    _hf_config(src, n_layer=3)
    return _import(src, tmp / "run")


@case("tools", "import_partial_shard_index", "`import_hf` of shards whose model.safetensors.index.json omits tensors",
      check=nothing_written)
def _(p, tmp):
    from safetensors.torch import load_file, save_file

    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    sd = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    names, wmap = sorted(sd), {}
    for k in range(2):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: sd[n] for n in names[k::2]}, str(src / fname), metadata={"format": "pt"})
        wmap.update({n: fname for n in names[k::2]})
    omitted = {n for n in names if ".mlp." in n}
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.numel() * 4 for t in sd.values())},
         "weight_map": {n: f for n, f in wmap.items() if n not in omitted}}))
    return _import(src, tmp / "run")


@case("tools", "import_unexpected_tensor", "`import_hf` of weights holding a tensor the model lacks",
      check=nothing_written)
def _(p, tmp):
    import torch

    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    _hf_weights(src, lambda sd: sd.__setitem__("transformer.h.4.attn.c_attn.weight", torch.zeros(32, 96)))
    return _import(src, tmp / "run")


@case("tools", "import_shape_mismatch", "`import_hf` of a LayerNorm weight of 33 values in a hidden-32 model",
      check=nothing_written)
def _(p, tmp):
    import torch

    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    _hf_weights(src, lambda sd: sd.__setitem__("transformer.h.0.ln_1.weight", torch.ones(33)))
    return _import(src, tmp / "run")


@case("tools", "import_nan_weight", "`import_hf` of weights holding a NaN", check=nothing_written)
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    _hf_weights(src, lambda sd: sd["transformer.h.0.attn.c_proj.weight"].view(-1).__setitem__(7, float("nan")))
    return _import(src, tmp / "run")


@case("tools", "import_config_bad_value", "`import_hf` of a config.json with `n_layer: \"three\"`",
      check=nothing_written)
def _(p, tmp):
    src = shutil.copytree(fixture(p, "hf"), tmp / "hf")
    _hf_config(src, n_layer="three")
    return _import(src, tmp / "run")


@case("tools", "import_tokenizer_swapped", "export an imported run whose merges.txt was edited after the import")
def _(p, tmp):
    run = copy_of(p, "run_tp2", tmp / "run")
    f = run / "tokenizer" / "merges.txt"
    lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[10], lines[11] = lines[11], lines[10]
    f.write_text("".join(lines), encoding="utf-8")
    return _export(run, tmp / "hf")
