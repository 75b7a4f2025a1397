"""Universal checkpoints (issue 42 item 3): the partition info every checkpoint carries (training.universal_info)
against every parameter of the GPT-2, Llama and BERT models and the TP layers that hold them, DeepSpeed's own merge
(``ds_to_universal.merge_tp_slices``) rebuilding each whole tensor from TP 2 shards with it, and the one-line
refusals of ``train.load_universal`` (config) and of a folder that is not a universal checkpoint; DeepSpeed's own
loader (``universal_checkpoint.load_hp_checkpoint_state``) cutting each merged tensor back into the TP 2 shards and
the TP 1 whole, which a TP change at a universal load relies on."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from deepspeed.checkpoint import ds_to_universal, enable_universal_checkpoint
from deepspeed.checkpoint.constants import (
    PARAM,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_SUB_PARAMS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    VOCABULARY_PARAMETER_PATTERNS,
)
from deepspeed.utils.tensor_fragment import get_hp_fragment_mapping

from megatron_ds_suite.core.errors import ConfigError
from training.config import load_config
from training.ds_json import deepspeed_config
from training.models.bert import BertModel
from training.models.config import padded_vocab_size
from training.models.gpt2 import GPTModel
from training.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from training.parallel.sharding import is_vocab_sized, shard
from training.universal import check_vocab, universal_tag
from training.universal_info import COLUMN, REPLICATED, ROW, SUB_PARAMS, classify, universal_checkpoint_info

ROOT = Path(__file__).resolve().parents[2]
TP = 2
MODELS = {  # config, overrides: GPT-2 ([Q; K; V] stride 3, tied embeddings), Llama (GQA stride 1, SwiGLU stride 2,
    # untied output layer), Llama without GQA (stride-3 QKV beside SwiGLU), BERT (LM-head bias, pooler, SOP head)
    "gpt2": ("gpt2_tiny.yaml", []),
    "llama": ("llama_tiny.yaml", []),
    "llama_mha": ("llama_tiny.yaml", ["model.num_query_groups=6"]),
    "bert": ("bert_tiny.yaml", []),
}


def _model(which: str) -> tuple[torch.nn.Module, int]:
    path, ov = MODELS[which]
    cfg = load_config(ROOT / "configs" / path, [f"parallel.tensor={TP}", "model.vocab_size=1000", *ov])
    m = cfg.model
    padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, TP)
    build = BertModel if m.arch == "bert" else GPTModel
    return build(m, padded, None, seed=1), padded  # TP 1: the whole tensors, tagged as at any TP


def _expected(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's category from the layer that holds it (not from its tag)."""
    out = {}
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(module, ColumnParallelLinear):
                out[full] = SUB_PARAMS if module.weight.partition_stride > 1 else COLUMN
            elif isinstance(module, RowParallelLinear):
                out[full] = ROW if name == "weight" else REPLICATED
            elif isinstance(module, VocabParallelEmbedding) or is_vocab_sized(full):
                out[full] = COLUMN  # the vocabulary rows (BERT's LM-head bias is a bare vocab-parallel tensor)
            else:
                out.setdefault(full, REPLICATED)  # norms, position/token-type embeddings, pooler and heads
    return out


def _rank_view(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s shard of every parameter (``training.parallel.sharding.shard`` by its tag)."""
    return {n: shard(p.detach(), p.partition_dim, rank, TP, getattr(p, "partition_stride", 1))
            if classify(p) != REPLICATED else p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("which", sorted(MODELS))
def test_partition_info_matches_every_parameter_by_its_layer(which):
    model, padded = _model(which)
    expected = _expected(model)
    assert set(expected) == {n for n, _ in model.named_parameters()}
    # the info of a TP-2 rank: rank 0's shard shapes, tags kept
    local = _rank_view(model, 0)
    for n, p in model.named_parameters():
        p.data = local[n]
    info = universal_checkpoint_info(model, padded, TP)
    lists = {REPLICATED: info[TP_REPLICATED_PARAMETER_PATTERNS], ROW: info[PARAMETER_WITH_ROW_PARALLELISM_PATTERNS],
             SUB_PARAMS: [pat for s in info[PARAMETER_WITH_SUB_PARAMS] for pat in s["patterns"]]}
    for name, p in model.named_parameters():
        assert classify(p) == expected[name], name
        hits = {kind for kind, pats in lists.items() for pat in pats if re.match(pat, name)}
        assert hits == ({expected[name]} if expected[name] != COLUMN else set()), name  # column: DeepSpeed's default
        in_vocab = any(re.match(pat, name) for pat in info[VOCABULARY_PARAMETER_PATTERNS])
        assert in_vocab == (is_vocab_sized(name) and p.dim() == 2), name
    assert info["original_vocab_size"] == padded  # the trained padding rows are kept
    # one pattern per parameter type, not per layer
    assert not any(re.search(r"\.\d+\.", pat) for pats in lists.values() for pat in pats)


def _deepspeed_load(folder: Path, shape: torch.Size, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """What DeepSpeed's universal loader gives TP rank ``rank`` of ``tp`` for a parameter of this rank's ``shape``
    (one DP partition holding all of it): the fp32 master it copies in and the Adam moments it keeps."""
    lp = torch.nn.Parameter(torch.zeros(shape))
    hp = torch.full((lp.numel(),), float("nan"))
    lp._hp_mapping = get_hp_fragment_mapping(lp, 0, hp, {}, {}, False, 0, 0, lp.numel())
    enable_universal_checkpoint([lp])
    lp.load_hp_checkpoint_state(str(folder), rank, tp)
    return {"fp32": hp.view(shape), **{k: v.view(shape) for k, v in lp._hp_mapping.optim_fragment.items()}}


@pytest.mark.parametrize("which", sorted(MODELS))
def test_deepspeed_merges_tp2_shards_into_the_whole_tensors(which, tmp_path):
    """DeepSpeed's own merge (``ds_to_universal.merge_tp_slices``) with the info rebuilds every whole parameter
    bitwise from TP 2 shards, and uses every pattern (its strict check); its loader cuts each merged fp32 master
    and Adam moment back into every TP 2 rank's shard and the TP 1 whole, bitwise."""
    model, padded = _model(which)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    shards = [_rank_view(model, r) for r in range(TP)]
    for n, p in model.named_parameters():
        p.data = shards[0][n]
    info = universal_checkpoint_info(model, padded, TP)
    slices, out = tmp_path / "slices", tmp_path / "zero"
    unmatched = []
    for name in full:
        for rank in range(TP):
            flat = shards[rank][name].flatten()
            for i, state in enumerate(("fp32", "exp_avg", "exp_avg_sq")):  # a different tensor per state
                ds_to_universal.dump_param_fragment(str(slices), rank, 0, state, flat + i, name, 0, flat.numel())
        shapes = [shards[r][name].shape for r in range(TP)]
        unmatched.append(set(ds_to_universal.merge_tp_slices(info, str(out), str(slices), TP, (name, shapes))))
        merged = torch.load(out / name / "fp32.pt", weights_only=False)[PARAM]
        assert torch.equal(merged, full[name]), name
        for tp, want in ((TP, shards), (1, [full])):  # TP 2 -> 2 (and 1 -> 2), TP 2 -> 1
            for rank in range(tp):
                got = _deepspeed_load(out / name, want[rank][name].shape, rank, tp)
                for i, state in enumerate(("fp32", "exp_avg", "exp_avg_sq")):
                    assert torch.equal(got[state], want[rank][name] + i), (name, tp, rank, state)
    assert not set.intersection(*unmatched)


def test_load_universal_refusals_are_one_line(tmp_path):
    gpt = ROOT / "configs" / "gpt2_tiny.yaml"
    cases = [
        (["train.load_universal=/u", "parallel.zero_stage=0"],
         r"^train.load_universal with parallel.zero_stage=0: DeepSpeed's universal load fills its ZeRO optimizers"),
        (["train.load_universal=/u", "parallel.zero_stage=1", "parallel.pipeline=2"],
         r"^train.load_universal with parallel.pipeline=2: universal checkpoints load here with parallel.pipeline=1"),
        (["train.load_universal=/u", "parallel.zero_stage=1", "train.init_from=/r"],
         r"^train.load_universal=/u with train.init_from=/r: a run starts from one source"),
        (["deepspeed={checkpoint: {load_universal: true}}"], r"^deepspeed.checkpoint.load_universal is derived from "
                                                            r"train.load_universal"),
    ]
    for ov, msg in cases:
        with pytest.raises(ConfigError, match=msg) as e:
            load_config(gpt, ov)
        assert "\n" not in str(e.value)
    (tmp_path / "u").mkdir()
    with pytest.raises(ConfigError, match=r"is not a universal checkpoint \(no latest_universal naming a folder with "
                                          r"zero/\): write one with python -m training.tools.to_universal"):
        universal_tag(tmp_path / "u")


def test_the_deepspeed_json_asks_for_the_universal_load_only_when_told():
    cfg = load_config(ROOT / "configs" / "gpt2_tiny.yaml", ["train.load_universal=/u", "parallel.zero_stage=2"])
    assert deepspeed_config(cfg, 2, "fp32", from_universal=True)["checkpoint"] == {"load_universal": True}
    assert "checkpoint" not in deepspeed_config(cfg, 2, "fp32")  # resuming its own checkpoints: DeepSpeed's layout


def test_a_run_from_a_universal_checkpoint_keeps_the_source_padded_vocabulary():
    check_vocab("/u", 1024, 1024, 1)  # TP 2 -> 1 with 1024 rows at both: nothing to say
    with pytest.raises(ConfigError, match=r"^train.load_universal=/u has a padded vocabulary of 1024 rows but this run "
                                          r"pads to 1152 at TP=1: set model.make_vocab_size_divisible_by=1024 to keep "
                                          r"them$"):
        check_vocab("/u", 1024, 1152, 1)
    with pytest.raises(ConfigError, match=r"pads to 1152 at TP=3: choose a parallel.tensor that divides 1024$"):
        check_vocab("/u", 1024, 1152, 3)
