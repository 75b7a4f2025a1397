"""Context parallelism (``parallel.context``, ``parallel.context_impl``; issue 43 item 1), on 2 and 4 gloo ranks.

CP 2 equals CP 1 for GPT-2 and the Llama shape (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied), with
DeepSpeed-Ulysses and with ring attention, under the DeepSpeed engine in fp32 with AdamW for two optimizer steps:
the loss of every step and every gradient the optimizer receives (a step pre-hook, i.e. after the engine's
reduction over the data x context parallel ranks). Loss and first-step gradients within 1e-5 relative (a
gradient: the norm of the difference over the reference's norm, per parameter); the second step's gradients
within 1e-4, since Adam's first update is about +-lr wherever a gradient is tiny, so the ring's other summation
order (1e-7 relative on the first step's gradients) can move those weights by up to 2 lr. The reference is CP 1
on the same ranks as data-parallel replicas fed the same samples (their averaged gradient is the serial one).

On 4 ranks: CP 4 (the packed Llama shape with 8 heads in 2 groups) against CP 1; TP 2 x CP 2 with sequence parallelism (each CP rank's tokens split again over TP) against TP 2 x CP 1
without it, gradient shard by shard (SP on = off is tests/parallel/test_sequence_parallel.py's, TP 2 = TP 1
tests/parallel/test_gpt2_tp.py's), and its losses against TP 1, for a Llama shape with one key/value head per TP
rank. The 2-rank Llama runs with CP recompute every layer in backward (``model.recompute: full``: the all-to-alls
and the ring run again). Dropout is off.

Packed documents (``llama+docs``: ``data.reset_position_ids``, ``reset_attention_mask`` and ``eod_mask_loss``, the
CP ranks' parts from training/data/context_documents.py): CP 2 against the non-CP document path
(training/tasks/gpt.py's), on two rows of 4 documents with boundaries inside ring chunks and Ulysses halves and a
document across the CP split, within the same tolerances.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 128
EOD = 0
STEPS = 2
SEQ = 16


def _model_cfg(name: str):
    from training.models.config import ModelConfig

    if name == "gpt2":
        return ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB,
                           hidden_dropout=0.0, attention_dropout=0.0)
    model = yaml.safe_load((ROOT / "configs" / "llama_tiny.yaml").read_text())["model"]
    model.update(num_layers=2, seq_length=SEQ, vocab_size=VOCAB)
    if name == "llama8":  # 8 heads in 2 groups: TP 2 leaves one key/value head per rank, fewer than CP 2
        model.update(num_attention_heads=8, num_query_groups=2)
    return ModelConfig(**model)


def _packed_sample() -> torch.Tensor:
    """[2, SEQ + 1] tokens alike on every rank; with EODs (id 0) at token positions 2, 6, 10 (row 0) and 4, 7, 13
    (row 1): 4 documents a row, boundaries inside CP chunks (ring chunks of 4, Ulysses halves of 8) and a document
    (7-10, 8-13) across the CP split."""
    seq = torch.randint(1, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(101))
    seq[0, [2, 6, 10]] = EOD
    seq[1, [4, 7, 13]] = EOD
    return seq


def _train(model_name: str, cp: int, impl: str, tp: int = 1, sp: bool = False, recompute: str = "none",
           documents: bool = False) -> dict:
    from training.config import Config
    from training.data.context_documents import context_part
    from training.data.documents import DocumentMasks, masked_mean
    from training.ds_json import deepspeed_config
    from training.models.gpt2 import GPTModel
    from training.optim.adamw import build_optimizer
    from training.optim.engine import build_engine
    from training.parallel import random as tp_random
    from training.parallel.context import ContextParallel
    from training.parallel.state import ParallelState

    cfg = Config()
    cfg.model = _model_cfg(model_name)
    cfg.parallel.tensor, cfg.parallel.context, cfg.parallel.context_impl = tp, cp, impl
    cfg.parallel.sequence_parallel = sp
    cfg.model.recompute = recompute
    ps = ParallelState(tp=tp, cp=cp)
    dp = ps.dims.dp
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.iters = 2, 2 * dp, STEPS
    cfg.optimizer.lr, cfg.optimizer.warmup_iters = 1e-3, 0
    tp_random.configure(ps, cfg.model.num_layers)
    tp_random.set_seed(1234)
    context = ContextParallel(ps.cp_group, impl) if cp > 1 else None
    model = GPTModel(cfg.model, VOCAB, ps.tp_group, seed=1234, sequence_parallel=sp, context=context)
    opt, sched = build_optimizer(model, cfg.optimizer, STEPS)
    engine = build_engine(model, opt, sched, deepspeed_config(cfg, dp, "fp32"), ps)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    seen: list[dict] = []
    engine.optimizer.register_step_pre_hook(lambda o, *_: seen.append(
        {names[id(p)]: p.grad.detach().clone() for grp in o.param_groups for p in grp["params"]
         if p.grad is not None}))
    seq = (_packed_sample() if documents else
           torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(100)))  # alike on every rank
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    docs = DocumentMasks.from_options(EOD, documents, documents, documents)
    losses = []
    for _ in range(STEPS):
        if context is None and docs is not None:  # the non-CP path (training/tasks/gpt.py)
            positions, mask, loss_mask = docs.of(tokens)
            loss = masked_mean(engine(tokens, labels, positions=positions, attn_mask=mask), loss_mask)
        elif context is None:
            loss = engine(tokens, labels).mean()
        else:
            part = context_part(context, docs, tokens, labels)
            loss = context.loss(engine(part.tokens, part.labels, positions=part.positions, attn_mask=part.attn_mask),
                                part.loss_mask)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": seen, "seq_dp": engine.seq_dp_world_size, "dp": engine.dp_world_size}


def _worker(rank: int, world: int, model_names: tuple[str, ...], tp: int, cp: int = 2) -> dict:
    out = {}
    for case in model_names:
        model_name, documents = case.removesuffix("+docs"), case.endswith("+docs")
        ref = _train(model_name, 1, "ulysses", tp, documents=documents)  # the same TP: the same gradient shards
        tp1 = ref if tp == 1 else _train(model_name, 1, "ulysses", 1)
        for impl in ("ulysses", "ring"):
            # with TP: sequence parallelism too; the Llama shape recomputes its layers (the exchanges run again)
            run = _train(model_name, cp, impl, tp, sp=tp > 1, recompute="full" if model_name == "llama" else "none",
                         documents=documents)
            assert len(run["grads"]) == len(ref["grads"]) == STEPS
            rel = [max(((g - ref_g[n]).norm() / ref_g[n].norm().clamp_min(1e-30)).item() for n, g in run_g.items())
                   for ref_g, run_g in zip(ref["grads"], run["grads"])]
            out[(case, impl)] = {"ref": ref["losses"], "cp": run["losses"], "grad_rel": rel, "tp1": tp1["losses"],
                                       "names": all(a.keys() == b.keys() for a, b in zip(ref["grads"], run["grads"])),
                                       "groups": (run["seq_dp"], run["dp"])}
    return out


@pytest.mark.parametrize("models,tp,cp", [
    (("gpt2", "llama", "llama+docs"), 1, 2),  # +docs: data.reset_position_ids, reset_attention_mask, eod_mask_loss
    (("llama8",), 2, 2),  # TP 2 x CP 2 (+ SP) = TP 1 (Ulysses repeating the one key/value head per TP rank first)
    (("llama8+docs",), 1, 4),  # CP 4: 8 ring chunks of 2 tokens; Ulysses repeating 2 key/value heads for 4 ranks
])
def test_context_parallel_equals_cp1(models, tp, cp):
    for r in run_distributed(_worker, cp * tp, models, tp, cp, timeout=600):
        assert set(r) == {(m, impl) for m in models for impl in ("ulysses", "ring")}
        for case, res in r.items():
            assert res["names"], case
            assert res["groups"] == (cp, 1), (case, res["groups"])  # gradients reduced over dp x cp, averaged by dp
            assert res["cp"] == pytest.approx(res["ref"], rel=1e-5), (case, res)
            assert res["cp"] == pytest.approx(res["tp1"], rel=1e-5), (case, res)
            assert res["ref"][-1] < res["ref"][0], (case, res)  # it trains
            assert res["grad_rel"][0] < 1e-5 and max(res["grad_rel"]) < 1e-4, (case, res["grad_rel"])
