"""import_hf on folders whose weights do not fit their config.json (issue 38): transformers' loading fills a missing
tensor with random values and drops an unexpected one; the import reads the files itself and refuses each case in one
line naming the tensors, writing nothing. The imported run records the tokenizer's identity, so a tokenizer file
swapped afterwards is refused where the run is read (evaluation, export).

Source: a random transformers GPT-2 (2 layers, hidden 32, 2 heads, the GPT-2 vocabulary; tests/helpers/hf_models.py)
and a random Llama for the ``tokenizer.json`` kind, damaged one way per case.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.hf_models import GPT2_TOKENIZER

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not GPT2_TOKENIZER.is_dir(), reason="../shared/data/tokenizers/gpt2 absent")
V = 50257


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from tests.helpers.hf_models import save_random_gpt2

    return save_random_gpt2(tmp_path_factory.mktemp("hf") / "gpt2", n_positions=32, n_layer=2, n_embd=32, n_head=2)


@pytest.fixture(scope="module")
def imported(source, tmp_path_factory):
    from training.tools.import_hf import import_hf

    return import_hf(str(source), tmp_path_factory.mktemp("run") / "run")


def _copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "hf"))


def _edit_weights(folder: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(folder / "model.safetensors"))
    fn(sd)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(folder: Path, **values) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **values}))


def _refused(folder: Path, tmp_path: Path, *patterns: str) -> str:
    """import_hf of ``folder`` fails with one SuiteError line holding every pattern, writing nothing."""
    from megatron_ds_suite.core.errors import SuiteError
    from training.tools.import_hf import import_hf

    with pytest.raises(SuiteError) as info:
        import_hf(str(folder), tmp_path / "out")
    msg = str(info.value)
    assert "\n" not in msg
    for p in patterns:
        assert p in msg, msg
    assert not (tmp_path / "out").exists()
    return msg


def _shard(folder: Path, omit: set[str] = frozenset(), files: int = 2) -> dict[str, str]:
    """model.safetensors -> ``files`` shards and model.safetensors.index.json, as save_pretrained writes them; the
    index leaves out the names in ``omit``. Returns the full weight map."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(sd)
    wmap = {}
    for k in range(files):
        part = names[k::files]
        fname = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        save_file({n: sd[n] for n in part}, str(folder / fname), metadata={"format": "pt"})
        wmap.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": {n: f for n, f in wmap.items() if n not in omit}}))
    return wmap


# --- tensors the files lack, hold extra, or hold in another shape -------------------------------------------------
@pytest.mark.parametrize("name", ["transformer.h.1.mlp.c_fc.weight", "transformer.ln_f.bias", "transformer.wpe.weight"])
def test_a_missing_tensor_is_refused(source, tmp_path, name):
    folder = _copy(source, tmp_path)
    _edit_weights(folder, lambda sd: sd.pop(name))
    _refused(folder, tmp_path, "1 missing", name)


def test_a_missing_tensor_in_a_pytorch_model_bin_is_refused(source, tmp_path):
    from safetensors.torch import load_file

    folder = _copy(source, tmp_path)
    sd = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    sd.pop("transformer.h.0.attn.c_proj.bias")
    torch.save(sd, folder / "pytorch_model.bin")
    _refused(folder, tmp_path, "1 missing (transformer.h.0.attn.c_proj.bias)")


@pytest.mark.parametrize("layers", [3, 5])
def test_more_layers_in_config_json_than_in_the_weights_are_refused(source, tmp_path, layers):
    folder = _copy(source, tmp_path)
    _edit_config(folder, n_layer=layers)
    _refused(folder, tmp_path, f"{12 * (layers - 2)} missing (transformer.h.2.ln_1.weight",
             f"config.json says {layers} layers but the weights hold 2")


@pytest.mark.parametrize("name,shape", [("transformer.h.7.attn.c_attn.weight", (32, 96)), ("transformer.extra", (3,))])
def test_an_unexpected_tensor_is_refused(source, tmp_path, name, shape):
    folder = _copy(source, tmp_path)
    _edit_weights(folder, lambda sd: sd.__setitem__(name, torch.zeros(shape)))
    _refused(folder, tmp_path, f"1 unexpected ({name})")


@pytest.mark.parametrize("name,shape", [("transformer.h.0.ln_1.weight", (33,)),
                                        ("transformer.h.1.mlp.c_fc.weight", (128, 32))])
def test_a_tensor_of_another_shape_is_refused(source, tmp_path, name, shape):
    folder = _copy(source, tmp_path)
    _edit_weights(folder, lambda sd: sd.__setitem__(name, torch.zeros(shape)))
    want = {"transformer.h.0.ln_1.weight": "[32]", "transformer.h.1.mlp.c_fc.weight": "[32, 128]"}[name]
    _refused(folder, tmp_path, f"1 of another shape ({name} {list(shape)}, the model's {want})")


@pytest.mark.parametrize("name,value", [("transformer.h.0.ln_1.weight", float("nan")),
                                        ("transformer.wte.weight", float("inf")),
                                        ("transformer.h.1.mlp.c_proj.bias", float("-inf"))])
def test_nan_or_inf_weights_are_refused(source, tmp_path, name, value):
    folder = _copy(source, tmp_path)

    def damage(sd):
        sd[name].view(-1)[5] = value

    _edit_weights(folder, damage)
    _refused(folder, tmp_path, "1 weight tensor(s) hold NaN or Inf values", name)


# --- shard indexes -----------------------------------------------------------------------------------------------
def test_a_complete_shard_index_imports_the_same_weights(source, imported, tmp_path):
    from training.checkpoint_reader import load_merged_state_dict
    from training.tools.import_hf import import_hf

    folder = _copy(source, tmp_path)
    _shard(folder, files=3)
    a, _, _ = load_merged_state_dict(import_hf(str(folder), tmp_path / "out"))
    b, _, _ = load_merged_state_dict(imported)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("omit", ["one", "a_whole_shard"])
def test_a_shard_index_that_omits_tensors_is_refused(source, tmp_path, omit):
    folder = _copy(source, tmp_path)
    wmap = _shard(folder)
    if omit == "one":
        leave_out = {"transformer.h.1.attn.c_attn.weight"}
        _shard_index_rewrite(folder, wmap, leave_out)
        _refused(folder, tmp_path, "model.safetensors.index.json omits 1 tensor(s) its shards hold",
                 "transformer.h.1.attn.c_attn.weight")
    else:  # the index forgets one shard file altogether: its tensors are missing
        second = sorted(set(wmap.values()))[1]
        leave_out = {n for n, f in wmap.items() if f == second}
        _shard_index_rewrite(folder, wmap, leave_out)
        _refused(folder, tmp_path, f"{len(leave_out)} missing")


def _shard_index_rewrite(folder: Path, wmap: dict[str, str], leave_out: set[str]) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: f for n, f in wmap.items() if n not in leave_out}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_shard_index_naming_files_outside_its_folder_is_refused(source, tmp_path):
    folder = _copy(source, tmp_path)
    wmap = _shard(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: "../" + f for n, f in wmap.items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(folder, tmp_path, "names shard files outside its folder")


# --- config.json values --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value", [("n_layer", "three"), ("resid_pdrop", [0.1]), ("n_inner", "big"),
                                       ("layer_norm_epsilon", 0), ("attn_pdrop", 1.5)])
def test_a_bad_config_json_value_is_one_line(source, tmp_path, key, value):
    folder = _copy(source, tmp_path)
    _edit_config(folder, **{key: value})
    _refused(folder, tmp_path, "config.json", key)


def test_the_command_prints_one_line_and_exits_2(source, tmp_path, capsys):
    from training.tools.import_hf import main

    folder = _copy(source, tmp_path)
    _edit_config(folder, n_layer="three")
    rc = main(["--model", str(folder), "--out", str(tmp_path / "out")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and " INFO " not in line]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and "n_layer" in err[0], err


# --- the tokenizer's identity ----------------------------------------------------------------------------------
def _swap_merges(path: Path) -> None:
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[1], lines[2] = lines[2], lines[1]
    path.write_text("".join(lines), encoding="utf-8")


def _swap_vocab_ids(path: Path) -> None:
    vocab = json.loads(path.read_text(encoding="utf-8"))
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    path.write_text(json.dumps(vocab), encoding="utf-8")


def test_the_imported_run_records_the_tokenizers_identity(imported):
    from megatron_ds_suite.core.tokenizer_base import sha256_file
    from training.checkpoint_reader import read_client_state

    spec = read_client_state(imported)["tokenizer"]
    assert (spec["kind"], spec["vocab_size"], spec["eod"]) == ("gpt2_bpe", V, 50256)
    assert spec["sha256"] == {"vocab_file": sha256_file(imported / "tokenizer" / "vocab.json"),
                              "merges_file": sha256_file(imported / "tokenizer" / "merges.txt")}
    assert spec["sha256"]["merges_file"] == sha256_file(GPT2_TOKENIZER / "gpt2-merges.txt")


@pytest.mark.parametrize("damage", ["merges", "vocab"])
def test_a_tokenizer_swapped_in_an_imported_run_is_refused_downstream(imported, tmp_path, damage):
    from megatron_ds_suite.core.errors import SuiteError
    from training.checkpoint_reader import load_model_for_eval
    from training.tools.export_hf import export

    run = Path(shutil.copytree(imported, tmp_path / "run"))
    if damage == "merges":
        _swap_merges(run / "tokenizer" / "merges.txt")
    else:
        _swap_vocab_ids(run / "tokenizer" / "vocab.json")
    name = "merges.txt" if damage == "merges" else "vocab.json"
    with pytest.raises(SuiteError, match=f"{name} has sha256 .* another tokenizer"):
        load_model_for_eval(run)
    with pytest.raises(SuiteError, match=f"{name} has sha256 .* another tokenizer"):
        export(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_tokenizer_json_swapped_in_an_imported_llama_is_refused(tmp_path):
    from megatron_ds_suite.core.errors import SuiteError
    from tests.helpers.hf_models import save_random_llama
    from training.checkpoint_reader import load_model_for_eval, read_client_state
    from training.tools.import_hf import import_hf

    run = import_hf(str(save_random_llama(tmp_path / "llama")), tmp_path / "run")
    spec = read_client_state(run)["tokenizer"]
    assert spec["kind"] == "hf" and set(spec["sha256"]) == {"tokenizer_file"} and spec["eod"] == 50256
    path = run / "tokenizer" / "tokenizer.json"
    tj = json.loads(path.read_text(encoding="utf-8"))
    tj["model"]["merges"][0], tj["model"]["merges"][1] = tj["model"]["merges"][1], tj["model"]["merges"][0]
    path.write_text(json.dumps(tj), encoding="utf-8")
    with pytest.raises(SuiteError, match="tokenizer.json has sha256 .* another tokenizer"):
        load_model_for_eval(run)
