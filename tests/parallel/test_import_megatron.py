"""Megatron-LM checkpoints in (issue 29, capability 2): ``training.tools.import_megatron`` against tensors made by
Megatron's own modules, with logits equal to Megatron's forward (fp32, 1e-5).

Recipe (Megatron-Core from PyPI: ``megatron-core==0.16.1``, the ``test`` extra; no GPU):

1. Two gloo ranks build Megatron-Core's ``GPTModel`` (``get_gpt_layer_local_spec``) and ``BertModel``
   (``bert_layer_local_spec``, binary head, two token types) at TP=2 with ``use_cpu_initialization``, dropout 0,
   ``bias_activation_fusion`` on (its fused tanh bias-GeLU, like legacy Megatron's ``--bias-gelu-fusion``
   default) and ``F.gelu`` (BERT's LM head stays the exact GeLU, as in legacy Megatron). Every parameter gets
   seeded noise (biases and norms would otherwise be 0 / 1). Shims, CPU only: the attention's global memory
   buffer (allocated on ``torch.cuda.current_device()``) returns ``torch.empty`` on the CPU, and the model-parallel
   RNG tracker's ``fork`` is a no-op (dropout is 0: no number is drawn), RoPE's "current device" is the CPU; vocab-parallel logits are all-gathered
   here (Megatron's gather allocates on CUDA). Each rank returns its logits and its own state dict shards.
2. Those shards are written in the legacy file layout of Megatron-LM's ``checkpointing.py`` and
   ``legacy/model`` (``{save}/iter_0000007/mp_rank_XX/model_optim_rng.pt`` + ``latest_checkpointed_iteration.txt``;
   ``model -> language_model -> embedding / encoder / pooler``, ``lm_head``, ``binary_head``; ``args`` as an
   ``argparse.Namespace`` with Megatron's argument names and its real ``ModelType``/``AttnBackend`` enums,
   numpy RNG state, ``checkpoint_version``). Megatron-Core's ``linear_qkv`` shard is the legacy
   ``query_key_value`` shard of version 2.0/3.0 (per head [q; k; v], its ``[np, 3, hn]`` rows); versions 1.0
   ([np, hn, 3]) and 0 ([3, np, hn]) are written by permuting those rows, the inverse of Megatron's
   ``fix_query_key_value_ordering`` / ``_transpose_first_dim``.
3. ``import_megatron`` reads them at TP=1 and TP=2 (and a PP=2 split of the same files); our model's logits over
   the real vocabulary equal Megatron-Core's.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.megatron_core_models import (
    GPT2_DIR,
    LLAMA_ARGS,
    POS,
    F,
    G,
    H,
    L,
    N,
    S,
    inputs,
    megatron_args,
    megatron_worker,
    noise,
    write_bert_vocab,
)


# Megatron-Core name -> legacy (megatron/legacy/model) name, the layout of Megatron-LM's released checkpoints
def _legacy_name(name: str) -> str | None:
    for a, b in (("decoder.", "language_model.encoder."), ("encoder.", "language_model.encoder."),
                 ("embedding.", "language_model.embedding."), ("pooler.", "language_model.pooler."),
                 ("output_layer.bias", "lm_head.bias"), ("lm_head.layer_norm", "lm_head.layernorm")):
        if name.startswith(a):
            name = b + name[len(a):]
    if name.startswith("output_layer."):
        return None  # the tied head: Megatron-LM saves it only on a last stage without the embedding
    for a, b in ((".self_attention.linear_qkv", ".self_attention.query_key_value"),
                 (".self_attention.linear_proj", ".self_attention.dense"), (".pre_mlp_layernorm", ".post_attention_layernorm"),
                 (".mlp.linear_fc1", ".mlp.dense_h_to_4h"), (".mlp.linear_fc2", ".mlp.dense_4h_to_h")):
        name = name.replace(a, b)
    return name


def _to_version(t: torch.Tensor, heads: int, version: float) -> torch.Tensor:
    """A [np, 3, hn] (version >= 2) QKV shard in the row order of ``version`` (inverse of Megatron's fix)."""
    rest = t.shape[1:]
    hn = t.size(0) // (3 * heads)
    v = t.view(heads, 3, hn, *rest)
    if version == 0:
        v = v.transpose(0, 1)                                      # [3, np, hn]
    elif version == 1.0:
        v = v.transpose(1, 2)                                      # [np, hn, 3]
    return v.contiguous().view(t.shape)


def _nest(flat: dict[str, torch.Tensor]) -> dict:
    """Megatron's nesting: model[language_model][embedding|encoder|pooler][sub-module] = its state dict."""
    out: dict = {}
    for name, t in flat.items():
        parts = name.split(".")
        # language_model.embedding.<module>.<param>, language_model.<encoder|pooler>.<param>, <head>.<param>
        depth = (3 if parts[1] == "embedding" else 2) if parts[0] == "language_model" else 1
        node = out
        for key in parts[:depth]:
            node = node.setdefault(key, {})
        node[".".join(parts[depth:])] = t
    return out


def write_core_checkpoint(save: Path, shards: list[dict], arch: str, vocab: int, pp: int = 1, te_names: bool = False,
                          iteration: int = 9, **arg_overrides) -> Path:
    """What Megatron-LM's ``--ckpt-format torch`` saves for a Megatron-Core model: per rank ``model`` = the model's
    flat state dict (``decoder.layers.i`` numbered from 0 on every pipeline stage; the embedding on the first stage,
    the final norm and the output layer on the last), checkpoint_version 3.0. ``te_names``: the norms as Transformer
    Engine's fused ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``."""
    args = megatron_args(shards, arch, vocab, pp, iteration, **arg_overrides)
    per_stage = L // pp
    for r, shard in enumerate(shards):
        for s in range(pp):
            stage = {}
            for name, t in shard.items():
                m = re.match(r"(decoder|encoder)\.layers\.(\d+)\.(.+)", name)
                if m and int(m.group(2)) // per_stage == s:
                    body = m.group(3)
                    if te_names:
                        body = body.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
                        body = body.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
                    stage[f"{m.group(1)}.layers.{int(m.group(2)) - s * per_stage}.{body}"] = t
                elif not m and (name.startswith("embedding.") and s == 0 or not name.startswith("embedding.")
                                and s == pp - 1):
                    stage[name] = t
            if pp > 1 and s == pp - 1 and "output_layer.weight" not in shard and arch != "bert":
                stage["output_layer.weight"] = shard["embedding.word_embeddings.weight"]  # the tied copy
            state = {"args": args, "iteration": iteration, "model": stage, "checkpoint_version": 3.0,
                     "rng_state": [{"np_rng_state": np.random.RandomState(0).get_state(),
                                    "torch_rng_state": torch.get_rng_state()}]}
            d = save / f"iter_{iteration:07d}" / (f"mp_rank_{r:02d}" + (f"_{s:03d}" if pp > 1 else ""))
            d.mkdir(parents=True)
            torch.save(state, d / "model_optim_rng.pt")
    (save / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return save


def write_megatron_checkpoint(save: Path, shards: list[dict], arch: str, vocab: int, version: float | None,  # noqa: C901
                              pp: int = 1, iteration: int = 7, **arg_overrides) -> Path:
    """Legacy Megatron-LM files from Megatron-Core shards (module docstring, step 2); ``version`` None = 3.0;
    ``pp`` = 2 splits the layers over two stages as Megatron's pipeline does (embedding on the first, the final
    norm, heads and the tied ``word_embeddings_for_head`` on the last)."""
    tp = len(shards)
    args = megatron_args(shards, arch, vocab, pp, iteration, **arg_overrides)
    folder = save / f"iter_{iteration:07d}"
    per_stage = L // pp
    for r, shard in enumerate(shards):
        flat = {}
        for name, t in shard.items():
            legacy = _legacy_name(name)
            if name == "output_layer.weight" and arg_overrides.get("untie_embeddings_and_output_weights"):
                legacy = "language_model.output_layer.weight"  # legacy Megatron's untied head
            if legacy is None:
                continue
            if legacy.endswith(("query_key_value.weight", "query_key_value.bias")) and version is not None:
                t = _to_version(t, N // tp, version)
            flat[legacy] = t
        for s in range(pp):
            stage = {}
            for name, t in flat.items():
                if ".layers." in name:
                    i = int(name.split(".layers.")[1].split(".")[0])
                    if i // per_stage == s:
                        stage[name.replace(f".layers.{i}.", f".layers.{i - s * per_stage}.")] = t
                elif name.startswith("language_model.embedding.") and s == 0:
                    stage[name] = t
                elif not name.startswith("language_model.embedding.") and s == pp - 1:
                    stage[name] = t
            if pp > 1 and s == pp - 1:
                stage["word_embeddings_for_head.weight"] = flat["language_model.embedding.word_embeddings.weight"]
            state = {"args": args, "iteration": iteration, "model": _nest(stage),
                     "rng_state": [{"random_rng_state": (3, tuple(range(5)), None),
                                    "np_rng_state": np.random.RandomState(0).get_state(),
                                    "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}],
                     "num_floating_point_operations_so_far": 0}
            if version is not None and version != 0:
                state["checkpoint_version"] = version
            elif version is None:
                state["checkpoint_version"] = 3.0
            d = folder / (f"mp_rank_{r:02d}" + (f"_{s:03d}" if pp > 1 else ""))
            d.mkdir(parents=True)
            torch.save(state, d / "model_optim_rng.pt")
    (save / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return save


def _exported_equals_megatrons(out: Path, shards: list[dict], vocab: int) -> None:
    """``export_megatron``'s Megatron-Core files at TP=len(shards) hold exactly Megatron-Core's own state dict shards:
    the same names, shapes and values (the vocabulary's padding rows, random in Megatron and zero in ours, left out)."""
    from training import safe_load
    from training.tools.megatron_reader import allowed_globals

    tp = len(shards)
    for r, want in enumerate(shards):
        path = next((out / f"iter_{0:07d}").glob(f"mp_rank_{r:02d}")) / "model_optim_rng.pt"
        with torch.serialization.safe_globals(allowed_globals()):
            got = safe_load.load(path)["model"]
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        for name, t in want.items():
            assert got[name].shape == t.shape, name
            if name in ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias"):
                real = max(0, min(t.size(0), vocab - r * t.size(0)))
                t, got[name] = t[:real], got[name][:real]
            assert torch.equal(got[name], t.float()), name
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "0" and tp >= 1


def _our_worker(rank: int, world: int, run: str, tokens, types_, pad):
    """Our model at the run's TP from its own shard files: full logits over the padded vocabulary."""
    from training import safe_load
    from training.config import config_from_dict
    from training.models.bert import BertModel
    from training.models.gpt2 import GPTModel

    folder = Path(run) / "checkpoints" / "iter_0000000"
    state = safe_load.load(folder / f"mp_rank_{rank:02d}_model_states.pt")
    cfg = config_from_dict(state["config"])
    group = torch.distributed.group.WORLD
    cls = BertModel if cfg.model.arch == "bert" else GPTModel
    model = cls(cfg.model, state["padded_vocab_size"], group, seed=0)
    model.load_state_dict(state["module"], strict=True)
    model.eval()
    with torch.no_grad():
        if cfg.model.arch == "bert":
            logits, sop = model(tokens, types_, pad)
        else:
            logits, sop = model(tokens), None
    parts = [torch.empty_like(logits) for _ in range(world)]
    torch.distributed.all_gather(parts, logits.contiguous())
    return torch.cat(parts, -1), sop


def _agree(what: str, ours, ref, sop, ref_sop) -> None:
    """Logits (and BERT's 2-way logits) equal to Megatron's within 1e-5 (fp32); the largest difference is printed
    (``pytest -s``) for the agreement figures in docs/megatron_interop.md."""
    worst = (ours - ref).abs().max().item()
    if sop is not None:
        worst = max(worst, (sop - ref_sop).abs().max().item())
    print(f"{what}: max |logit difference| {worst:.2e}")
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    if sop is not None:
        torch.testing.assert_close(sop, ref_sop, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def bert_vocab(tmp_path_factory) -> Path:
    """A WordPiece vocab.txt of 300 entries (specials, letters, word pieces)."""
    return write_bert_vocab(tmp_path_factory.mktemp("bert_vocab") / "vocab.txt")


def _import(src: Path, out: Path, tp: int, arch: str, bert_vocab: Path, pp: int = 1) -> Path:
    from training.tools.import_megatron import import_megatron

    if arch == "gpt2":
        return import_megatron(src, out, tp, pp, vocab_file=str(GPT2_DIR / "gpt2-vocab.json"),
                               merge_file=str(GPT2_DIR / "gpt2-merges.txt"))
    return import_megatron(src, out, tp, pp, vocab_file=str(bert_vocab))


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_megatron_tp2_checkpoint_imports_at_tp1_and_tp2_with_megatrons_logits(arch, bert_vocab, tmp_path):
    pytest.importorskip("megatron.core", reason="the test extra's megatron-core (Megatron's own modules)")
    from megatron_ds_suite.core.tokenizer import load_tokenizer
    from training.checkpoint_reader import load_model_for_eval

    if arch == "gpt2" and not GPT2_DIR.is_dir():
        pytest.skip("../shared/data/tokenizers/gpt2 absent")
    if arch == "gpt2":
        vocab = load_tokenizer({"kind": "gpt2_bpe", "vocab_file": str(GPT2_DIR / "gpt2-vocab.json"),
                                "merges_file": str(GPT2_DIR / "gpt2-merges.txt")}).vocab_size
    else:
        vocab = 300
    padded = 64 * -(-vocab // 64)                                # Megatron's rule: divisible by 32 x TP=2
    tokens, types_, pad = inputs(vocab)
    pad[1, S - 3:] = 0 if arch == "bert" else 1
    meg = run_distributed(megatron_worker, 2, arch, padded, tokens, types_, pad, timeout=240)
    ref, ref_sop = meg[0][0][..., :vocab], meg[0][1]
    shards = [m[2] for m in meg]
    versions = (None, 2.0, 1.0, 0) if arch == "gpt2" else (None, 0)
    keep = pad.bool()  # Megatron also masks padded queries: padded positions are not compared
    for version in versions:
        src = write_megatron_checkpoint(tmp_path / f"meg_v{version}", shards, arch, vocab, version)
        run = _import(src, tmp_path / f"ours_v{version}_tp1", 1, arch, bert_vocab)
        model, cfg, _ = load_model_for_eval(run)  # in this process, as evaluation loads it
        assert cfg.model.activation == "gelu_new" and cfg.model.lm_head_activation == ("gelu" if arch == "bert" else None)
        with torch.no_grad():
            ours, sop = model(tokens, types_, pad) if arch == "bert" else (model(tokens), None)
        _agree(f"{arch} Megatron-Core TP=2 -> ours TP=1, checkpoint_version {3.0 if version is None else version}", ours[..., :vocab][keep],
               ref[keep], sop, ref_sop)
    core = write_core_checkpoint(tmp_path / "meg_core", shards, arch, vocab)  # Megatron-Core's own names
    model, _, _ = load_model_for_eval(_import(core, tmp_path / "ours_core", 1, arch, bert_vocab))
    with torch.no_grad():
        ours, sop = model(tokens, types_, pad) if arch == "bert" else (model(tokens), None)
    _agree(f"{arch} Megatron-Core layout TP=2 -> ours TP=1", ours[..., :vocab][keep], ref[keep], sop, ref_sop)
    from training.tools.export_megatron import export_megatron  # and back: Megatron-Core's own shards exactly

    _exported_equals_megatrons(export_megatron(tmp_path / "ours_core", tmp_path / "back", tp=2), shards, vocab)
    run2 = _import(src, tmp_path / "ours_tp2", 2, arch, bert_vocab)
    for ours, sop in run_distributed(_our_worker, 2, str(run2), tokens, types_, pad):
        _agree(f"{arch} Megatron-Core TP=2 -> ours TP=2", ours[..., :vocab][keep], ref[keep], sop, ref_sop)
    if arch == "bert":  # refused in one line each: a vocabulary of another size, a shape our BERT does not compute
        from training.tools.import_megatron import import_megatron
        from training.tools.megatron_reader import ImportMegatronError

        bigger = tmp_path / "vocab400.txt"
        bigger.write_text(bert_vocab.read_text() + "".join(f"x{i}\n" for i in range(100)))
        with pytest.raises(ImportMegatronError, match="wrong --vocab-file"):
            import_megatron(src, tmp_path / "refused_vocab", 1, vocab_file=str(bigger))
        swiglu = write_megatron_checkpoint(tmp_path / "meg_swiglu", shards, arch, vocab, None, swiglu=True)
        with pytest.raises(ImportMegatronError, match="swiglu=True"):
            import_megatron(swiglu, tmp_path / "refused_swiglu", 1, vocab_file=str(bert_vocab))
        assert not (tmp_path / "refused_vocab").exists() and not (tmp_path / "refused_swiglu").exists()
    if arch == "gpt2":  # a source at TP=2 x PP=2 (stage folders mp_rank_XX_YYY) to ours at TP=1 x PP=2
        src_pp = write_megatron_checkpoint(tmp_path / "meg_pp2", shards, arch, vocab, None, pp=2)
        run_pp = _import(src_pp, tmp_path / "ours_pp2", 1, arch, bert_vocab, pp=2)
        from training.checkpoint_reader import load_merged_state_dict

        merged_pp, cfg_pp, _ = load_merged_state_dict(run_pp)
        merged_1, _, _ = load_merged_state_dict(tmp_path / "ours_vNone_tp1")
        assert cfg_pp.parallel.pipeline == 2
        assert set(merged_pp) == set(merged_1)
        for name, w in merged_1.items():
            assert torch.equal(merged_pp[name], w), name


def test_megatron_core_llama_shape_imports_from_either_layout_at_any_tp_pp_with_megatrons_logits(tmp_path):
    """Megatron-Core's GPTModel with the Llama options (RoPE of base 5000, RMSNorm, SwiGLU, 4 heads in 2 key/value
    groups, untied output, no biases) at TP=2, saved in Megatron-Core's layout (local and Transformer Engine norm
    names, PP=1 and 2) and in the legacy layout: ours imported at TP=1, TP=2 and PP=2 gives its logits (1e-5)."""
    pytest.importorskip("megatron.core", reason="the test extra's megatron-core (Megatron's own modules)")
    from megatron_ds_suite.core.tokenizer import load_tokenizer
    from training.checkpoint_reader import load_merged_state_dict, load_model_for_eval
    from training.tools.import_megatron import import_megatron
    from training.tools.megatron_reader import ImportMegatronError

    if not GPT2_DIR.is_dir():
        pytest.skip("../shared/data/tokenizers/gpt2 absent")
    vocab = load_tokenizer({"kind": "gpt2_bpe", "vocab_file": str(GPT2_DIR / "gpt2-vocab.json"),
                            "merges_file": str(GPT2_DIR / "gpt2-merges.txt")}).vocab_size
    padded = 64 * -(-vocab // 64)
    tokens, types_, pad = inputs(vocab)
    meg = run_distributed(megatron_worker, 2, "llama", padded, tokens, types_, pad, timeout=240)
    ref, shards = meg[0][0][..., :vocab], [m[2] for m in meg]
    assert any(k.endswith("linear_qkv.weight") for k in shards[0]) and "output_layer.weight" in shards[0]
    run1 = _import(write_core_checkpoint(tmp_path / "core", shards, "gpt2", vocab, **LLAMA_ARGS),
                   tmp_path / "ours_tp1", 1, "gpt2", None)
    model, cfg, _ = load_model_for_eval(run1)
    m = cfg.model
    assert (m.position_embedding, m.rotary_base, m.normalization, m.activation, m.num_query_groups,
            m.untie_embeddings_and_output_weights, m.add_bias_linear) == ("rope", 5000.0, "rmsnorm", "swiglu", G,
                                                                          True, False)
    with torch.no_grad():
        _agree("Llama shape, Megatron-Core layout TP=2 -> ours TP=1", model(tokens)[..., :vocab], ref, None, None)
    for ours, _ in run_distributed(_our_worker, 2, str(_import(tmp_path / "core", tmp_path / "ours_tp2", 2, "gpt2",
                                                                None)), tokens, types_, pad):
        _agree("Llama shape, Megatron-Core layout TP=2 -> ours TP=2", ours[..., :vocab], ref, None, None)
    # the same weights from TP=2 x PP=2 files with Transformer Engine's norm names, and from the legacy layout
    merged_1, _, _ = load_merged_state_dict(run1)
    te = write_core_checkpoint(tmp_path / "core_te_pp2", shards, "gpt2", vocab, pp=2, te_names=True, **LLAMA_ARGS)
    legacy = write_megatron_checkpoint(tmp_path / "legacy", shards, "gpt2", vocab, None, **LLAMA_ARGS)
    for src, pp in ((te, 2), (legacy, 1)):
        merged, cfg_o, _ = load_merged_state_dict(_import(src, tmp_path / f"ours_{src.name}", 1, "gpt2", None, pp=pp))
        assert cfg_o.parallel.pipeline == pp and set(merged) == set(merged_1), src.name
        for name, w in merged_1.items():
            assert torch.equal(merged[name], w), (src.name, name)
    # and back: Megatron-Core's own shards exactly at TP=2; at TP=1 x PP=2 and in the legacy layout, the same weights
    from training.tools.export_megatron import export_megatron

    _exported_equals_megatrons(export_megatron(run1, tmp_path / "back_tp2", tp=2), shards, vocab)
    for pp, layout in ((2, "core"), (1, "legacy")):
        back = export_megatron(run1, tmp_path / f"back_{layout}_pp{pp}", tp=1, pp=pp, layout=layout)
        merged, _, _ = load_merged_state_dict(_import(back, tmp_path / f"again_{layout}", 1, "gpt2", None, pp=pp))
        assert set(merged) == set(merged_1) and all(torch.equal(merged[n], w) for n, w in merged_1.items()), layout
    # what no model here computes: one line naming it, nothing written
    for key, value in (("qk_layernorm", True), ("num_experts", 8), ("rotary_interleaved", True)):
        bad = write_core_checkpoint(tmp_path / f"core_{key}", shards, "gpt2", vocab, **{**LLAMA_ARGS, key: value})
        with pytest.raises(ImportMegatronError, match=f"{key}={value}"):
            import_megatron(bad, tmp_path / f"refused_{key}", vocab_file=str(GPT2_DIR / "gpt2-vocab.json"),
                            merge_file=str(GPT2_DIR / "gpt2-merges.txt"))
        assert not (tmp_path / f"refused_{key}").exists()


class _CallsGetcwd:
    """Pickles as a call of ``os.getcwd`` (harmless, standing for ``os.system``)."""

    def __reduce__(self):
        import os

        return os.getcwd, ()


def test_a_pickle_asking_for_another_global_is_refused_in_one_line(tmp_path, capsys):
    """A model_optim_rng.pt whose pickle calls a function off the allow-list: the command prints one error line
    naming it and writes nothing."""
    from training.tools.import_megatron import main

    d = tmp_path / "meg" / "release" / "mp_rank_00"
    d.mkdir(parents=True)
    torch.save({"model": {}, "args": argparse.Namespace(x=_CallsGetcwd())}, d / "model_optim_rng.pt")
    (tmp_path / "meg" / "latest_checkpointed_iteration.txt").write_text("release")
    rc = main(["--checkpoint", str(tmp_path / "meg"), "--out", str(tmp_path / "out"), "--vocab-file", "x"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "refused to load" in err and "getcwd" in err
    assert not (tmp_path / "out").exists()


# --- Megatron-LM's own legacy model and checkpointing code (a source checkout) ---------------------------------
MEGATRON_LM_SOURCE = "MEGATRON_LM_SOURCE"
"""Environment variable naming a checkout of NVIDIA/Megatron-LM that still has ``megatron/legacy/model`` (tested:
6da62672cfb3c64bc9bfd9bf2eecd239dff4c0d1, 2026-04-13, the last commit with both legacy GPT and BERT; made with
``git --git-dir=MIRROR archive 6da62672cf megatron | tar -x -C DIR``)."""


def _legacymegatron_worker(rank: int, world: int, source: str, save: str, arch: str, padded: int, tokens, types_,
                            pad):
    """Megatron-LM's own ``megatron.legacy.model`` GPTModel/BertModel at TP=world, built from its own argument
    parser (``--use-legacy-models --transformer-impl local --ckpt-format torch``), run forward, and saved by its own
    ``megatron.training.checkpointing.save_checkpoint``. Shims, CPU only: no GPU arch query (``< 10``), apex's
    ``fused_layer_norm_affine`` -> ``torch.nn.functional.layer_norm`` (the same function), the global memory buffer
    and the model-parallel RNG fork as in :func:`megatron_worker`, ``torch.cuda.get_rng_state`` -> the CPU state,
    ``args.model_type`` as ``pretrain()`` sets it and ``args.apply_layernorm_1p`` (read by the legacy norm, no longer
    defined by this revision's arguments.py); the padded vocabulary is set as Megatron's tokenizer builder would."""
    import os
    import sys

    import torch.nn.functional as Fn

    sys.path.insert(0, source)
    for m in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[m]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # what Megatron asks of a TP run
    from megatron.training import arguments, global_vars

    arguments.get_device_arch_version = lambda: 0
    sys.argv = ["pretrain", "--num-layers", str(L), "--hidden-size", str(H), "--num-attention-heads", str(N),
                "--ffn-hidden-size", str(F), "--seq-length", "16", "--max-position-embeddings", str(POS),
                "--micro-batch-size", "1", "--tensor-model-parallel-size", str(world), "--use-legacy-models",
                "--use-cpu-initialization", "--hidden-dropout", "0", "--attention-dropout", "0", "--save", save,
                "--ckpt-format", "torch", "--no-gradient-accumulation-fusion", "--transformer-impl", "local",
                "--make-vocab-size-divisible-by", "32", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
                "--no-persist-layer-norm", "--save-interval", "10", "--train-iters", "10", "--lr", "0.0001",
                "--tokenizer-type", "GPT2BPETokenizer" if arch == "gpt2" else "BertWordPieceLowerCase"]
    args = arguments.parse_args()
    args.rank, args.world_size = rank, world
    arguments.validate_args(args)
    args.padded_vocab_size = padded
    from megatron.core.enums import ModelType

    args.model_type = ModelType.encoder_or_decoder
    args.apply_layernorm_1p = False
    global_vars.set_args(args)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    parallel_state.get_global_memory_buffer = lambda: types.SimpleNamespace(
        get_tensor=lambda shape, dtype, name, **kw: torch.empty(shape, dtype=dtype))
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    init_num_microbatches_calculator(rank, None, args.global_batch_size, args.micro_batch_size, args.data_parallel_size)
    torch.manual_seed(1234)
    sys.modules["fused_layer_norm_cuda"] = types.ModuleType("fused_layer_norm_cuda")
    from megatron.legacy.model import fused_layer_norm

    fused_layer_norm.fused_layer_norm_affine = lambda x, w, b, shape, eps: Fn.layer_norm(x, shape, w, b, eps)
    from megatron.legacy.model import BertModel, GPTModel
    from megatron.training.checkpointing import save_checkpoint

    config = arguments.core_transformer_config_from_args(args)
    if arch == "gpt2":
        model = GPTModel(config, num_tokentypes=0, parallel_output=True, pre_process=True, post_process=True)
    else:
        model = BertModel(config, num_tokentypes=2, add_binary_head=True, parallel_output=True, pre_process=True,
                          post_process=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(noise(name, rank, getattr(p, "tensor_model_parallel", False), p.shape))
    model.eval()
    b, s = tokens.shape
    with torch.no_grad():
        if arch == "gpt2":
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
            logits, sop = model(tokens, torch.arange(s)[None].expand(b, s), mask), None
        else:
            logits, sop = model(tokens, pad, tokentype_ids=types_)
    parts = [torch.empty_like(logits) for _ in range(world)]
    torch.distributed.all_gather(parts, logits.contiguous())
    save_checkpoint(3, [model], None, None, 0)
    return torch.cat(parts, -1), sop


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_checkpoint_written_by_megatron_lm_legacy_code_imports_with_its_logits(arch, bert_vocab, tmp_path):
    """Megatron-LM's own legacy model and save_checkpoint (source checkout in $MEGATRON_LM_SOURCE; skipped without
    one) write a TP=2 checkpoint (checkpoint_version 3.0); ours imported at TP=1 and TP=2 gives its logits."""
    import os

    from training.checkpoint_reader import load_model_for_eval

    source = os.environ.get(MEGATRON_LM_SOURCE)
    if not source or not (Path(source) / "megatron" / "legacy" / "model" / "gpt_model.py").is_file():
        pytest.skip(f"${MEGATRON_LM_SOURCE} does not name a Megatron-LM checkout with megatron/legacy/model")
    if arch == "gpt2" and not GPT2_DIR.is_dir():
        pytest.skip("../shared/data/tokenizers/gpt2 absent")
    vocab = 50257 if arch == "gpt2" else 300
    padded = 64 * -(-vocab // 64)
    tokens, types_, pad = inputs(vocab)
    if arch == "bert":
        pad[1, S - 3:] = 0
    save = tmp_path / "megatron_save"
    meg = run_distributed(_legacymegatron_worker, 2, source, str(save), arch, padded, tokens, types_, pad, timeout=300)
    ref, ref_sop = meg[0][0][..., :vocab], meg[0][1]
    keep = pad.bool()
    model, cfg, _ = load_model_for_eval(_import(save, tmp_path / "ours_tp1", 1, arch, bert_vocab))
    with torch.no_grad():
        ours, sop = model(tokens, types_, pad) if arch == "bert" else (model(tokens), None)
    results = [(ours, sop)] + run_distributed(_our_worker, 2, str(_import(save, tmp_path / "ours_tp2", 2, arch,
                                                                          bert_vocab)), tokens, types_, pad)
    for tp, (ours, sop) in zip((1, 2, 2), results):
        _agree(f"{arch} Megatron-LM legacy TP=2 -> ours TP={tp}", ours[..., :vocab][keep], ref[keep], sop, ref_sop)


def test_old_qkv_orders_read_as_megatrons_own_fix_query_key_value_ordering(monkeypatch):
    """Megatron-LM's own ``_transpose_first_dim`` (what ``fix_query_key_value_ordering`` applies to versions 0 and
    1.0, from the $MEGATRON_LM_SOURCE checkout) turns the test's version-0 / 1.0 shards back into the version-3.0
    shard, and the importer reads all three as the same queries, keys and values."""
    import os
    import sys

    from training.tools.megatron_weights import qkv_parts

    source = os.environ.get(MEGATRON_LM_SOURCE)
    if not source or not (Path(source) / "megatron" / "training" / "checkpointing.py").is_file():
        pytest.skip(f"${MEGATRON_LM_SOURCE} does not name a Megatron-LM checkout")
    monkeypatch.syspath_prepend(source)
    saved = {m: sys.modules.pop(m) for m in list(sys.modules) if m == "megatron" or m.startswith("megatron.")}
    try:
        from megatron.training.checkpointing import _transpose_first_dim

        heads, hn, h = 3, 4, 10
        attention = types.SimpleNamespace(hidden_size_per_attention_head=hn, num_attention_heads_per_partition=heads)
        model = types.SimpleNamespace(language_model=types.SimpleNamespace(encoder=types.SimpleNamespace(
            layers=[types.SimpleNamespace(self_attention=attention)])))
        for shape in ((3 * heads * hn, h), (3 * heads * hn,)):
            v3 = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
            want = qkv_parts(v3, heads, heads, 3.0)
            for version in (0, 1.0):
                old = _to_version(v3, heads, version)
                assert not torch.equal(old, v3)
                assert torch.equal(_transpose_first_dim(old.clone(), 3, version == 0, model), v3)
                assert all(map(torch.equal, qkv_parts(old, heads, heads, version), want))
    finally:
        for m in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
            del sys.modules[m]
        sys.modules.update(saved)
