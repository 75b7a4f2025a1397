"""``import_megatron`` on hostile or inconsistent rank files, ``reshard`` onto itself or from damaged
checkpoints, and the small tools (``megatron-ds-configs copy``, ``training.plan``, the main job).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from tests.hostile.case import case
from tests.hostile.damage import binary_file, nothing_written, run_intact, snap_save
from tests.hostile.fixtures import GPT2_TOK, copy_of, fixture, latest_tag_dir
from tests.hostile.probe import Probe


def _megatron(src: Path, out: Path) -> list[str]:
    return ["python", "-m", "training.tools.import_megatron", "--checkpoint", str(src), "--out", str(out),
            "--vocab-file", str(GPT2_TOK / "gpt2-vocab.json"), "--merge-file", str(GPT2_TOK / "gpt2-merges.txt")]


def _megatron_copy(p: Probe, tmp: Path) -> Path:
    """A private copy of a tiny Megatron-LM GPT-2 saved at TP=2 (legacy layout). Written by this probe's own
    checkout (megatron_ds_suite/app/megatron_files.py): the files are Megatron's format, not the checkout's."""
    with p.lock:
        if "megatron" not in p.fixtures:
            from megatron_ds_suite.app.megatron_files import write_megatron_gpt2

            write_megatron_gpt2(p.base / "fixtures" / "megatron", tp=2)
            p.fixtures["megatron"] = p.base / "fixtures" / "megatron"
    return Path(shutil.copytree(p.fixtures["megatron"], tmp / "meg"))


def _megatron_edit(src: Path, fn, ranks=("mp_rank_00", "mp_rank_01")) -> None:
    import torch

    for r in ranks:
        f = src / "iter_0000007" / r / "model_optim_rng.pt"
        state = torch.load(f, weights_only=False)
        fn(state)
        torch.save(state, f)


def _names_missing_rank(p, tmp, res):
    return None if "mp_rank_01/model_optim_rng.pt" in res.out else "the error does not name the missing rank file"


@case("tools", "import_megatron_ok", "import a tiny TP=2 Megatron-LM GPT-2 (control)", "ok")
def _(p, tmp):
    return _megatron(_megatron_copy(p, tmp), tmp / "run")


@case("tools", "import_megatron_shared_dicts", "a 1 KB model_optim_rng.pt whose dicts hold the next one twice, 40 deep",
      timeout=60)
def _(p, tmp):
    from megatron_ds_suite.app.megatron_files import shared_dicts

    src = _megatron_copy(p, tmp)
    _megatron_edit(src, lambda s: s.__setitem__("model", shared_dicts(40, 0.0)))
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_deep_nesting", "a model state nested 5,000 dicts deep")
def _(p, tmp):
    import torch

    from megatron_ds_suite.app.megatron_files import nested_dicts, torch_save_deep

    src = _megatron_copy(p, tmp)
    for r in ("mp_rank_00", "mp_rank_01"):
        f = src / "iter_0000007" / r / "model_optim_rng.pt"
        state = torch.load(f, weights_only=False)
        state["model"]["language_model"]["encoder"]["junk"] = nested_dicts(5000, 0.0)
        torch_save_deep(state, f)
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_cyclic", "a model state dict that holds itself")
def _(p, tmp):
    def damage(state):
        enc = state["model"]["language_model"]["encoder"]
        enc["loop"] = enc

    src = _megatron_copy(p, tmp)
    _megatron_edit(src, damage)
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_rank_iteration", "rank files of two iterations (mp_rank_01 of iteration 8)",
      check=nothing_written)
def _(p, tmp):
    src = _megatron_copy(p, tmp)
    _megatron_edit(src, lambda s: s.__setitem__("iteration", 8), ranks=("mp_rank_01",))
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_rank_args", "rank files saved with other args (mp_rank_01: hidden_dropout 0.2)",
      check=nothing_written)
def _(p, tmp):
    src = _megatron_copy(p, tmp)
    _megatron_edit(src, lambda s: setattr(s["args"], "hidden_dropout", 0.2), ranks=("mp_rank_01",))
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_rank_shapes", "mp_rank_01's QKV shard of another shape")
def _(p, tmp):
    import torch

    src = _megatron_copy(p, tmp)
    _megatron_edit(src, lambda s: s["model"]["language_model"]["encoder"].__setitem__(
        "layers.0.self_attention.query_key_value.weight", torch.zeros(30, 16)), ranks=("mp_rank_01",))
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_missing_tp_rank", "a TP=2 checkpoint with mp_rank_01 deleted",
      check=_names_missing_rank)
def _(p, tmp):
    src = _megatron_copy(p, tmp)
    shutil.rmtree(src / "iter_0000007" / "mp_rank_01")
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_rank_count", "a third rank file beside a checkpoint whose args say TP=2",
      check=lambda p, tmp, res: None if "TP=2" in res.out else "the error does not name the checkpoint's TP")
def _(p, tmp):
    src = _megatron_copy(p, tmp)
    shutil.copytree(src / "iter_0000007" / "mp_rank_01", src / "iter_0000007" / "mp_rank_02")
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_replicated_differ", "a LayerNorm weight that differs between the two TP ranks",
      check=nothing_written)
def _(p, tmp):
    def damage(state):
        enc = state["model"]["language_model"]["encoder"]
        enc["layers.0.input_layernorm.weight"] = enc["layers.0.input_layernorm.weight"] + 0.01

    src = _megatron_copy(p, tmp)
    _megatron_edit(src, damage, ranks=("mp_rank_01",))
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_string_args", "args with `num_attention_heads: \"4\"` (a string)")
def _(p, tmp):
    src = _megatron_copy(p, tmp)
    _megatron_edit(src, lambda s: setattr(s["args"], "num_attention_heads", "4"))
    return _megatron(src, tmp / "run")


@case("tools", "import_megatron_nan", "a NaN in the MLP weight of both TP ranks", check=nothing_written)
def _(p, tmp):
    src = _megatron_copy(p, tmp)
    _megatron_edit(src, lambda s: s["model"]["language_model"]["encoder"][
        "layers.1.mlp.dense_h_to_4h.weight"].view(-1).__setitem__(3, float("nan")))
    return _megatron(src, tmp / "run")


def _reshard(ckpt: Path, out: Path, *extra: str) -> list[str]:
    return ["python", "-m", "training.tools.reshard", "--checkpoint", str(ckpt), "--out", str(out), *extra]


@case("tools", "reshard_into_itself", "`reshard --out` the run it reads", check=run_intact)
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    snap_save(tmp)
    return _reshard(run, run, "--tp", "1")


@case("tools", "reshard_tp_zero", "`reshard --tp 0`")
def _(p, tmp):
    return _reshard(fixture(p, "run"), tmp / "out", "--tp", "0")


@case("tools", "reshard_missing_shard", "reshard a TP=2 checkpoint with a shard deleted")
def _(p, tmp):
    run = copy_of(p, "run_tp2", tmp / "run")
    next((run / "checkpoints").glob("*/mp_rank_01_model_states.pt")).unlink()
    return _reshard(run, tmp / "out", "--tp", "1")


@case("tools", "reshard_tag_missing", "`reshard --tag` a tag that is not there")
def _(p, tmp):
    return _reshard(fixture(p, "run"), tmp / "out", "--tp", "1", "--tag", "iter_0000099")


@case("tools", "reshard_tag_escapes", "`reshard --tag ../../x`")
def _(p, tmp):
    return _reshard(fixture(p, "run"), tmp / "out", "--tp", "1", "--tag", "../../x")


@case("tools", "reshard_corpus_folder", "a corpus folder as `reshard --checkpoint`")
def _(p, tmp):
    return _reshard(fixture(p, "corpus"), tmp / "out", "--tp", "1")


@case("tools", "reshard_symlinked_tag", "reshard a run whose tag folder is a symlink")
def _(p, tmp):
    run = copy_of(p, "run", tmp / "run")
    tag = latest_tag_dir(run)
    shutil.move(str(tag), tmp / "moved")
    tag.symlink_to(tmp / "moved")
    return _reshard(run, tmp / "out", "--tp", "1")


CONFIGS = "from megatron_ds_suite.app.console import configs; configs()"


@case("tools", "configs_copy_onto_edited", "`megatron-ds-configs copy` onto an existing (edited) file",
      check=lambda p, tmp, res: None if (tmp / "mine.yaml").read_text() == "# my edits\n" else
      "the edited file was replaced")
def _(p, tmp):
    (tmp / "mine.yaml").write_text("# my edits\n")
    return ["python", "-c", CONFIGS, "copy", "gpt2_tiny.yaml", str(tmp / "mine.yaml")]


@case("tools", "configs_copy_missing_folder", "`megatron-ds-configs copy NAME DIR/MISSING/x.yaml`")
def _(p, tmp):
    return ["python", "-c", CONFIGS, "copy", "gpt2_tiny.yaml", str(tmp / "missing" / "x.yaml")]


@case("tools", "configs_copy_unknown", "`megatron-ds-configs copy` an unknown config name")
def _(p, tmp):
    return ["python", "-c", CONFIGS, "copy", "nosuch.yaml", str(tmp / "x.yaml")]


@case("tools", "plan_bad_config", "`python -m training.plan` on a binary config")
def _(p, tmp):
    binary_file(tmp / "c.yaml")
    return ["python", "-m", "training.plan", "--config", str(tmp / "c.yaml")]


@case("tools", "main_job_unknown_override", "`main_job` with an unknown override")
def _(p, tmp):
    return ["python", "-m", "megatron_ds_suite.main_job", "--config", p.configs("main/ci.yaml"), "nosuch.key=1"]
