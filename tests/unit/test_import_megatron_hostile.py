"""import_megatron on hostile or inconsistent rank files (issue 38): every case is one ImportMegatronError/TreeError line
naming the real cause, in seconds, with nothing written; the intact files import with their exact tensors.

The files are a tiny Megatron-LM GPT-2 in the legacy layout (``megatron_ds_suite/app/megatron_files.py``: 2 layers,
hidden 16, 4 heads, the GPT-2 vocabulary padded for TP=2), damaged one way per case.
"""
from __future__ import annotations

import argparse
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch

from megatron_ds_suite.app.megatron_files import nested_dicts, shared_dicts, torch_save_deep, write_megatron_gpt2
from tests.helpers.distributed import SHARED_DATA

GPT2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"
V = 50257
pytestmark = pytest.mark.skipif(not GPT2.is_dir(), reason="../shared/data/tokenizers/gpt2 absent")
FILE = "model_optim_rng.pt"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    return {(tp, pp): (root / f"tp{tp}pp{pp}", write_megatron_gpt2(root / f"tp{tp}pp{pp}", tp=tp, pp=pp))
            for tp, pp in [(2, 1), (2, 2), (4, 1)]}


def _copy(pristine, tmp_path, tp=2, pp=1) -> Path:
    return Path(shutil.copytree(pristine[(tp, pp)][0], tmp_path / "meg"))


def _rank(src: Path, name: str) -> Path:
    return src / "iter_0000007" / name / FILE


def _edit(path: Path, fn) -> None:
    state = torch.load(path, weights_only=False)
    fn(state)
    torch.save(state, path)


def _import(src: Path, out: Path):
    from training.tools.import_megatron import import_megatron

    return import_megatron(src, out, vocab_file=str(GPT2 / "gpt2-vocab.json"), merge_file=str(GPT2 / "gpt2-merges.txt"))


def _refused(src: Path, tmp_path: Path, *patterns: str, seconds: float = 30.0) -> str:
    """The import of ``src`` fails with one SuiteError line matching every pattern, within ``seconds``, writing
    nothing."""
    from megatron_ds_suite.core.errors import SuiteError

    t0 = time.monotonic()
    with pytest.raises(SuiteError) as info:
        _import(src, tmp_path / "out")
    msg = str(info.value)
    assert time.monotonic() - t0 < seconds
    assert "\n" not in msg
    for p in patterns:
        assert p in msg, msg
    assert not (tmp_path / "out").exists()
    return msg


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2), (4, 1)])
def test_intact_files_import_with_their_exact_tensors(pristine, tmp_path, tp, pp):
    from training.checkpoint_reader import load_merged_state_dict

    src, full = pristine[(tp, pp)]
    sd, cfg, meta = load_merged_state_dict(_import(src, tmp_path / "out"))
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.ffn_size, cfg.model.vocab_size) == (2, 16, 64, V)
    assert set(sd) == set(full)
    for name, t in full.items():
        assert torch.equal(sd[name][:V] if "word_embeddings" in name else sd[name], t[:V] if "word_embeddings" in name else t), name
    assert meta["tokenizer"]["vocab_size"] == V and meta["tokenizer"]["eod"] == 50256
    assert set(meta["tokenizer"]["sha256"]) == {"vocab_file", "merges_file"}


# --- structures no recursive walk survives ---------------------------------------------------------------------
@pytest.mark.parametrize("where", ["model", "encoder"])
def test_shared_subdicts_are_walked_once(pristine, tmp_path, where):
    """A 'billion laughs' of dicts (40 levels, each holding the next twice: 2**40 paths, a file of about a kilobyte)
    as the model or inside the encoder: refused in one line, in seconds (it hung the recursive walk)."""
    src = _copy(pristine, tmp_path)
    for name in ("mp_rank_00", "mp_rank_01"):
        def damage(state):
            if where == "model":
                state["model"] = shared_dicts(40, torch.zeros(1))
            else:
                state["model"]["language_model"]["encoder"]["junk"] = shared_dicts(40, torch.zeros(1))
        _edit(_rank(src, name), damage)
    if where == "model":  # the whole file: a few kilobytes
        assert _rank(src, "mp_rank_00").stat().st_size < 20_000
    _refused(src, tmp_path, "unknown", "a.a.a.a", seconds=20)


def test_shared_subdicts_outside_the_model_do_not_stop_an_import(pristine, tmp_path):
    """The same structure in a part the importer does not read (optimizer) is walked once: the weights import."""
    from training.checkpoint_reader import load_merged_state_dict

    src = _copy(pristine, tmp_path)
    for name in ("mp_rank_00", "mp_rank_01"):
        _edit(_rank(src, name), lambda s: s.__setitem__("optimizer", shared_dicts(60, 1.0)))
    t0 = time.monotonic()
    sd, _, _ = load_merged_state_dict(_import(src, tmp_path / "out"))
    assert time.monotonic() - t0 < 20
    assert torch.equal(sd["final_ln.weight"], pristine[(2, 1)][1]["final_ln.weight"])


def test_shared_subdicts_without_tensors_are_one_line(pristine, tmp_path):
    """The model as a 'billion laughs' of dicts holding no tensor at all: the walk ends and says what is missing."""
    src = _copy(pristine, tmp_path)
    for name in ("mp_rank_00", "mp_rank_01"):
        _edit(_rank(src, name), lambda s: s.__setitem__("model", shared_dicts(40, 0.0)))
    _refused(src, tmp_path, "holds no embedding.word_embeddings.weight", seconds=20)


@pytest.mark.parametrize("where", ["model", "encoder", "args"])
def test_deep_nesting_is_refused_in_one_line(pristine, tmp_path, where):
    src = _copy(pristine, tmp_path)
    for name in ("mp_rank_00", "mp_rank_01"):
        path = _rank(src, name)
        state = torch.load(path, weights_only=False)
        if where == "model":
            state["model"] = nested_dicts(5000, torch.zeros(1))
        elif where == "encoder":
            state["model"]["language_model"]["encoder"]["junk"] = nested_dicts(5000, torch.zeros(1))
        else:
            state["args"].data_path = nested_dicts(5000, "x")
        torch_save_deep(state, path)
    _refused(src, tmp_path, "nests containers more than 64 deep", "untrusted")


@pytest.mark.parametrize("shape", ["self", "pair"])
def test_cyclic_structures_are_refused_in_one_line(pristine, tmp_path, shape):
    src = _copy(pristine, tmp_path)

    def damage(state):
        enc = state["model"]["language_model"]["encoder"]
        if shape == "self":
            enc["loop"] = enc
        else:
            a, b = {}, {}
            a["b"], b["a"] = b, a
            state["model"]["language_model"]["extra"] = a

    for name in ("mp_rank_00", "mp_rank_01"):
        _edit(_rank(src, name), damage)
    _refused(src, tmp_path, "(a cyclic structure)", "untrusted")


# --- rank files that do not make one checkpoint ------------------------------------------------------------------
@pytest.mark.parametrize("what,change,expect", [
    ("iteration", lambda s: s.__setitem__("iteration", 8), "is of iteration 8 but"),
    ("args", lambda s: setattr(s["args"], "hidden_dropout", 0.2), "hidden_dropout=0.2 vs 0.1"),
    ("args_extra", lambda s: setattr(s["args"], "seq_length", 16), "seq_length=16 vs 32"),
    ("version", lambda s: s.__setitem__("checkpoint_version", 2.0), "is of checkpoint_version 2.0 but"),
])
def test_rank_files_of_another_iteration_or_args_are_refused(pristine, tmp_path, what, change, expect):
    src = _copy(pristine, tmp_path)
    _edit(_rank(src, "mp_rank_01"), change)
    _refused(src, tmp_path, "mp_rank_01", expect, "different checkpoints")


@pytest.mark.parametrize("tensor,shape", [("self_attention.query_key_value.weight", (30, 16)),
                                          ("mlp.dense_h_to_4h.weight", (40, 16)),
                                          ("input_layernorm.weight", (17,))])
def test_rank_files_with_other_shapes_are_refused(pristine, tmp_path, tensor, shape):
    src = _copy(pristine, tmp_path)
    _edit(_rank(src, "mp_rank_01"),
          lambda s: s["model"]["language_model"]["encoder"].__setitem__(f"layers.1.{tensor}", torch.zeros(shape)))
    _refused(src, tmp_path, "mp_rank_01", "of other shapes", f"{list(shape)}")


@pytest.mark.parametrize("tensor", ["layers.0.input_layernorm.weight", "final_layernorm.bias",
                                    "layers.1.mlp.dense_4h_to_h.bias"])
def test_replicated_tensors_that_differ_across_tp_ranks_are_refused(pristine, tmp_path, tensor):
    src = _copy(pristine, tmp_path)

    def damage(state):
        enc = state["model"]["language_model"]["encoder"]
        enc[tensor] = enc[tensor] + 1e-3

    _edit(_rank(src, "mp_rank_01"), damage)
    ours = {"layers.0.input_layernorm.weight": "layers.0.ln1.weight", "final_layernorm.bias": "final_ln.bias",
            "layers.1.mlp.dense_4h_to_h.bias": "layers.1.mlp.proj.bias"}[tensor]
    _refused(src, tmp_path, "1 tensor(s) every TP rank holds a copy of differ", ours, "mp_rank_00", "mp_rank_01")


def test_position_embeddings_that_differ_across_ranks_are_refused(pristine, tmp_path):
    src = _copy(pristine, tmp_path)
    _edit(_rank(src, "mp_rank_01"), lambda s: s["model"]["language_model"]["embedding"]["position_embeddings"]
          .__setitem__("weight", torch.zeros(32, 16)))
    _refused(src, tmp_path, "embedding.position_embeddings.weight", "differ")


# --- the rank files against the checkpoint's own TP x PP -----------------------------------------------------------
@pytest.mark.parametrize("tp,pp,delete,named", [
    (2, 1, ["mp_rank_01"], "mp_rank_01/model_optim_rng.pt"),
    (4, 1, ["mp_rank_02", "mp_rank_03"], "mp_rank_02/model_optim_rng.pt, mp_rank_03/model_optim_rng.pt"),
    (2, 2, ["mp_rank_01_000", "mp_rank_01_001"], "mp_rank_01_000/model_optim_rng.pt"),
])
def test_a_missing_tp_rank_is_named_not_blamed_on_the_vocabulary(pristine, tmp_path, tp, pp, delete, named):
    src = _copy(pristine, tmp_path, tp, pp)
    for name in delete:
        shutil.rmtree(src / "iter_0000007" / name)
    msg = _refused(src, tmp_path, named, f"args say TP={tp} x PP={pp}")
    assert "--vocab-file" not in msg


@pytest.mark.parametrize("change,expect", [
    ("extra_rank", "holds mp_rank_02/model_optim_rng.pt beyond its TP x PP"),
    ("args_pp2", "lacks mp_rank_00_001/model_optim_rng.pt, mp_rank_01_001/model_optim_rng.pt"),
    ("args_tp1", "holds mp_rank_01/model_optim_rng.pt beyond its TP x PP"),
])
def test_rank_files_are_counted_against_the_checkpoints_own_tp_pp(pristine, tmp_path, change, expect):
    src = _copy(pristine, tmp_path)
    if change == "extra_rank":
        shutil.copytree(src / "iter_0000007" / "mp_rank_01", src / "iter_0000007" / "mp_rank_02")
    else:
        key, value = {"args_pp2": ("pipeline_model_parallel_size", 2), "args_tp1": ("tensor_model_parallel_size", 1)}[change]
        for name in ("mp_rank_00", "mp_rank_01"):
            _edit(_rank(src, name), lambda s: setattr(s["args"], key, value))
    _refused(src, tmp_path, expect)


# --- args and values -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value,expect", [
    ("num_attention_heads", "2", "args.num_attention_heads='2' is not an integer >= 1"),
    ("num_layers", "2", "args.num_layers='2' is not an integer >= 1"),
    ("apply_query_key_layer_scaling", "False", "args.apply_query_key_layer_scaling='False' is not a boolean"),
    ("layernorm_epsilon", "1e-5", "args.layernorm_epsilon='1e-5' is not a number"),
    ("hidden_size", True, "args.hidden_size=True is not an integer >= 1"),
])
def test_string_typed_numbers_in_args_are_refused(pristine, tmp_path, key, value, expect):
    src = _copy(pristine, tmp_path)
    for name in ("mp_rank_00", "mp_rank_01"):
        _edit(_rank(src, name), lambda s: setattr(s["args"], key, value))
    _refused(src, tmp_path, expect)


@pytest.mark.parametrize("tensor,value", [("layers.0.mlp.dense_h_to_4h.weight", float("nan")),
                                          ("final_layernorm.weight", float("inf"))])
def test_non_finite_weights_are_refused(pristine, tmp_path, tensor, value):
    src = _copy(pristine, tmp_path)
    for name in ("mp_rank_00", "mp_rank_01"):
        def damage(state):
            t = state["model"]["language_model"]["encoder"][tensor]
            t.view(-1)[3] = value
        _edit(_rank(src, name), damage)
    ours = {"layers.0.mlp.dense_h_to_4h.weight": "layers.0.mlp.fc.weight", "final_layernorm.weight": "final_ln.weight"}
    _refused(src, tmp_path, "hold NaN or Inf values", ours[tensor])


def test_the_command_prints_one_line_and_exits_2(pristine, tmp_path, capsys):
    from training.tools.import_megatron import main

    src = _copy(pristine, tmp_path)
    shutil.rmtree(src / "iter_0000007" / "mp_rank_01")
    rc = main(["--checkpoint", str(src), "--out", str(tmp_path / "out"), "--vocab-file", str(GPT2 / "gpt2-vocab.json"),
               "--merge-file", str(GPT2 / "gpt2-merges.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and "lacks mp_rank_01/model_optim_rng.pt" in err[0]
    assert not (tmp_path / "out").exists()


def test_walker_bounds_and_sharing():
    """The walker itself: a shared container listed once, entries counted, depth bounded, cycles named."""
    from training.tools.untrusted_tree import TreeError, leaves

    shared = [1, 2]
    found = leaves({"a": shared, "b": shared, "n": argparse.Namespace(x=3)}, "f")
    assert found == [(("a", 0), 1), (("a", 1), 2), (("n", "x"), 3)]
    with pytest.raises(TreeError, match="more than 10 entries"):
        leaves({"a": list(range(11))}, "f", max_entries=10)
    with pytest.raises(TreeError, match="more than 3 deep"):
        leaves([[[[1]]]], "f", max_depth=3)
    assert leaves([[[1]]], "f", max_depth=3) == [((0, 0, 0), 1)]
    loop: list = []
    loop.append([loop])
    with pytest.raises(TreeError, match=r"f: 0\.0 is a container it lies inside"):
        leaves(loop, "f")


# --- Megatron-Core's layout and the Llama options ------------------------------------------------------------------
@pytest.mark.parametrize("change,expect", [
    ({"position_embedding_type": "rope"}, "position embeddings disagree with its args"),
    ({"group_query_attention": True, "num_query_groups": 3}, "3 key/value groups do not split"),
    ({"swiglu": True, "qk_layernorm": True}, "qk_layernorm=True"),
    ({"group_query_attention": True, "num_query_groups": 2, "checkpoint_version_1": True},
     "grouped-query attention in a checkpoint_version 1.0 file"),
])
def test_llama_options_that_disagree_with_the_tensors_are_one_line(pristine, tmp_path, change, expect):
    src = _copy(pristine, tmp_path)
    for name in ("mp_rank_00", "mp_rank_01"):
        def edit(state):
            for key, value in change.items():
                if key == "checkpoint_version_1":
                    state["checkpoint_version"] = 1.0
                else:
                    setattr(state["args"], key, value)
        _edit(_rank(src, name), edit)
    _refused(src, tmp_path, expect)


class _Runs:
    """Pickled, runs ``os.system`` when loaded: what a hostile ``.metadata`` file holds."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _damage_metadata_pickle(folder: Path) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(_Runs(f"touch {folder / 'pwned'}")))


@pytest.mark.parametrize("damage,expect", [
    (None, None),
    (lambda f: (f / "common.pt").unlink(), "lacks common.pt"),
    (lambda f: (f / ".metadata").unlink(), "lacks .metadata"),
    (lambda f: (f / "metadata.json").write_text('{"sharded_backend": "zarr"}'), "'zarr' distributed checkpoint"),
    (lambda f: (f / "metadata.json").write_text("{not json"), "not Megatron's dist-checkpoint marker"),
    (_damage_metadata_pickle, "asks to run posix.system"),
    (lambda f: next(f.glob("*.distcp")).write_bytes(next(f.glob("*.distcp")).read_bytes()[:200]),
     "a damaged or incomplete torch_dist checkpoint"),
], ids=["intact", "no-common", "no-metadata", "zarr", "bad-marker", "pickle-runs-code", "truncated-distcp"])
def test_a_torch_dist_folder_imports_or_is_one_line(damage, expect, tmp_path):
    """The same weights exported as torch_dist (``export_megatron --format torch_dist``) import to the same tensors;
    each damage is one line, writes nothing and runs nothing from the files."""
    from training.checkpoint_reader import load_merged_state_dict
    from training.tools.export_megatron import export_megatron

    write_megatron_gpt2(tmp_path / "src", tp=2, pp=1, layers=2)
    run = _import(tmp_path / "src", tmp_path / "run")
    dist = export_megatron(run, tmp_path / "dist", tp=2, iteration=100, fmt="torch_dist")
    folder = dist / "iter_0000100"
    assert (folder / "metadata.json").is_file() and not any(folder.glob("mp_rank_*"))
    if damage is None:
        merged, _, _ = load_merged_state_dict(run)
        back, _, _ = load_merged_state_dict(_import(dist, tmp_path / "back"))
        assert back.keys() == merged.keys() and all(torch.equal(back[k], merged[k]) for k in merged)
        return
    damage(folder)
    (tmp_path / "refused").mkdir()
    _refused(dist, tmp_path / "refused", expect)
    assert not (folder / "pwned").exists()


def test_gqa_and_swiglu_shards_merge_into_our_layout():
    """Two TP ranks' ``linear_qkv`` shards (per key/value group its query heads, key, value) and SwiGLU
    ``linear_fc1`` shards ([gate_r; up_r]) merge into ours: q, k, v as fuse_qkv lays them out, [gate; up]."""
    from training.models.qkv import fuse_qkv, split_qkv
    from training.tools.megatron_weights import merge_ranks

    heads, groups, hn, h, f = 8, 2, 3, 5, 6
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * hn, h, generator=g) for n in (heads, groups, groups))
    gate, up = torch.randn(f, h, generator=g), torch.randn(f, h, generator=g)
    per = heads // groups
    shards = []
    for r in range(2):  # rank r holds group r whole: its query heads, its key, its value
        qkv = torch.cat([q[r * per * hn:(r + 1) * per * hn], k[r * hn:(r + 1) * hn], v[r * hn:(r + 1) * hn]])
        fc = torch.cat([gate[r * f // 2:(r + 1) * f // 2], up[r * f // 2:(r + 1) * f // 2]])
        shards.append({"layers.0.attn.qkv.weight": qkv, "layers.0.mlp.fc.weight": fc})
    merged = merge_ranks(shards, heads, groups, 3.0, swiglu=True)
    assert torch.equal(merged["layers.0.attn.qkv.weight"], fuse_qkv(q, k, v, heads, groups))
    assert all(map(torch.equal, split_qkv(merged["layers.0.attn.qkv.weight"], heads, groups), (q, k, v)))
    assert torch.equal(merged["layers.0.mlp.fc.weight"], torch.cat([gate, up]))


def test_virtual_pipeline_chunks_import_in_megatrons_layer_order(tmp_path):
    """A TP=2 x PP=2 checkpoint with a virtual pipeline of 2 (``model0``, ``model1`` per rank file; chunk c of
    pipeline rank r holds global layer 2c + r, Megatron's assignment) made from the stage files of the same 4-layer
    model at PP=4: the import equals the tensors, and a file with chunks the args do not announce is one line."""
    from training.checkpoint_reader import load_merged_state_dict

    full = write_megatron_gpt2(tmp_path / "pp4", tp=2, pp=4, layers=4)
    src = tmp_path / "vpp"
    for t in range(2):
        for r in range(2):
            chunks = [torch.load(tmp_path / "pp4" / "iter_0000007" / f"mp_rank_{t:02d}_{c * 2 + r:03d}" / FILE,
                                 weights_only=False) for c in range(2)]
            state = {**chunks[0], "model0": chunks[0]["model"], "model1": chunks[1]["model"]}
            del state["model"]
            state["args"].pipeline_model_parallel_size, state["args"].virtual_pipeline_model_parallel_size = 2, 2
            (src / "iter_0000007" / f"mp_rank_{t:02d}_{r:03d}").mkdir(parents=True)
            torch.save(state, src / "iter_0000007" / f"mp_rank_{t:02d}_{r:03d}" / FILE)
    (src / "latest_checkpointed_iteration.txt").write_text("7")
    merged, cfg, _ = load_merged_state_dict(_import(src, tmp_path / "out"))
    assert cfg.model.num_layers == 4
    for name, t in full.items():
        want = t[:V] if name == "embedding.word_embeddings.weight" else t
        assert torch.equal(merged[name][:want.size(0)], want.float()), name
    for r in range(2):  # the args say no virtual pipeline: refused, nothing written
        _edit(src / "iter_0000007" / f"mp_rank_00_{r:03d}" / FILE,
              lambda s: setattr(s["args"], "virtual_pipeline_model_parallel_size", None))
        _edit(src / "iter_0000007" / f"mp_rank_01_{r:03d}" / FILE,
              lambda s: setattr(s["args"], "virtual_pipeline_model_parallel_size", None))
    (tmp_path / "refused").mkdir()
    _refused(src, tmp_path / "refused", "holds 2 model chunk(s) but the checkpoint's args say "
             "virtual_pipeline_model_parallel_size=1")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


@pytest.mark.parametrize("layout", ["core", "legacy"])
def test_export_with_a_virtual_pipeline_writes_megatrons_chunks_and_imports_back(layout, tmp_path):
    """``export_megatron --pp 2 --vp 2``: chunk c of pipeline rank r (``model{c}``) is exactly stage 2c + r of the
    same run exported at PP=4 (Megatron's interleaved assignment, the tied output copy in the last chunk), the args
    announce the virtual pipeline, and the files import back to the run's own weights."""
    from training.checkpoint_reader import load_merged_state_dict
    from training.tools.export_megatron import ExportMegatronError, export_megatron

    write_megatron_gpt2(tmp_path / "src", tp=2, pp=1, layers=4)
    run = _import(tmp_path / "src", tmp_path / "run")
    pp4 = export_megatron(run, tmp_path / "pp4", tp=2, pp=4, layout=layout)
    vpp = export_megatron(run, tmp_path / "vpp", tp=2, pp=2, vp=2, layout=layout)
    it = next(vpp.glob("iter_*")).name
    for t in range(2):
        for r in range(2):
            state = torch.load(vpp / it / f"mp_rank_{t:02d}_{r:03d}" / FILE, weights_only=False)
            assert "model" not in state and state["args"].virtual_pipeline_model_parallel_size == 2
            for c in range(2):
                want = _flat(torch.load(pp4 / it / f"mp_rank_{t:02d}_{c * 2 + r:03d}" / FILE,
                                        weights_only=False)["model"])
                got = _flat(state[f"model{c}"])
                assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), (t, r, c)
    merged, cfg, _ = load_merged_state_dict(run)
    back, back_cfg, _ = load_merged_state_dict(_import(vpp, tmp_path / "back"))
    assert back.keys() == merged.keys() and all(torch.equal(back[k], merged[k]) for k in merged)
    with pytest.raises(ExportMegatronError, match="--pp 2 x --vp 4 with 4 layers"):
        export_megatron(run, tmp_path / "bad", tp=1, pp=2, vp=4, layout=layout)
