"""``model.compile`` (issue 27): one compiled graph per transformer layer at TP = 1 and TP = 2 (gloo), numerics equal
to eager, dropout replayed exactly under activation recompute, and the trainer running compiled layers."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import needs_corpus, tiny_overrides

ROOT_CONFIG = "configs/gpt2_tiny.yaml"


LLAMA = dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu", num_query_groups=2,
             untie_embeddings_and_output_weights=True, add_bias_linear=False)


def _explain_worker(rank, world, dropout, extra=None):
    import torch._dynamo as dynamo

    from training.config import ModelConfig
    from training.models.blocks import TransformerLayer
    from training.parallel import random as tp_random
    from training.parallel.mappings import COLLECTIVE_CALLS
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=world)
    tp_random.configure(ps, 2)
    tp_random.set_seed(1)
    cfg = ModelConfig(hidden_size=64, num_attention_heads=4, hidden_dropout=dropout, attention_dropout=dropout,
                      **(extra or {}))
    layer = TransformerLayer(cfg, ps.tp_group, 1, 0).train()
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    COLLECTIVE_CALLS.clear()
    layer(x)
    eager_calls = dict(COLLECTIVE_CALLS)
    dynamo.reset()
    ex = dynamo.explain(layer)(x)
    reasons = sorted({r.reason.splitlines()[0] for r in ex.break_reasons})
    return ex.graph_count, ex.graph_break_count, reasons, eager_calls


@pytest.mark.parametrize("world,extra", [(1, None), (2, None), (1, LLAMA), (2, LLAMA)],
                         ids=["tp1", "tp2", "llama-tp1", "llama-tp2"])
def test_one_graph_per_layer_without_attention_dropout(world, extra):
    """No graph break in a layer at TP = 1 or TP = 2 (dynamo turns gloo's all-reduce into a functional
    collective), GPT-2's block and the Llama block (RoPE, RMSNorm, SwiGLU, GQA, no biases); the eager layer
    still counts its two forward all-reduces."""
    for graphs, breaks, reasons, eager_calls in run_distributed(_explain_worker, world, 0.0, extra):
        assert (graphs, breaks) == (1, 0), reasons
        assert eager_calls == ({"all_reduce": 2} if world == 2 else {})


def test_attention_dropout_runs_eagerly_between_graphs():
    """With attention dropout the only breaks are at the one call that switches to the model-parallel RNG
    stream (made ``torch.compiler.disable`` on purpose: a generator's state cannot be traced)."""
    graphs, breaks, reasons, _ = run_distributed(_explain_worker, 1, 0.1)[0]
    assert graphs <= 4 and reasons == ["Skip inlining `torch.compiler.disable()`d function"], reasons


def _grads_worker(rank, world, runs, extra=None):
    from training.config import ModelConfig
    from training.models.compile_layers import compile_layers
    from training.models.gpt2 import GPT2Model
    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=1)
    tp_random.configure(ps, 2)
    out = []
    for compiled, ckpt, p in runs:
        tp_random.set_seed(1)
        cfg = ModelConfig(hidden_size=64, num_attention_heads=4, num_layers=2, hidden_dropout=p, attention_dropout=p,
                          activation_checkpointing=ckpt, seq_length=32, **(extra or {}))
        model = GPT2Model(cfg, 128, None, seed=3).train()
        n = compile_layers(model) if compiled else 0
        tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
        tp_random.set_seed(5)
        loss = model(tokens, tokens).mean()
        loss.backward()
        out.append((n, loss.detach(), {k: q.grad.clone() for k, q in model.named_parameters()}))
    return out


@pytest.mark.parametrize("extra", [None, LLAMA], ids=["gpt2", "llama"])
def test_compiled_layers_equal_eager_and_replay_dropout_under_recompute(extra):
    """fp32, dropout 0: compiled (inductor) = eager to 1e-5, with and without activation checkpointing.
    Dropout 0.1: compiled with checkpointing gives bitwise the gradients of compiled without, i.e. recompute
    replays the masks the compiled forward drew. GPT-2's block and the Llama block."""
    runs = [(False, False, 0.0), (True, False, 0.0), (True, True, 0.0), (True, False, 0.1), (True, True, 0.1)]
    (_, l0, g0), (n1, l1, g1), (_, l2, g2), (_, l3, g3), (_, l4, g4) = run_distributed(_grads_worker, 1, runs,
                                                                                       extra)[0]
    assert n1 == 2
    for loss, grads in ((l1, g1), (l2, g2)):
        torch.testing.assert_close(loss, l0, rtol=1e-5, atol=1e-5)
        for k in g0:
            torch.testing.assert_close(grads[k], g0[k], rtol=1e-5, atol=1e-5)
    assert torch.equal(l3, l4)
    for k in g3:
        assert torch.equal(g3[k], g4[k]), k
    assert not torch.equal(l3, l0)  # dropout was on


def train_worker(rank, world, overrides):
    from pathlib import Path

    from training.config import load_config
    from training.trainer import Trainer

    cfg = load_config(Path(ROOT_CONFIG).resolve(), overrides)
    trainer = Trainer(cfg)
    trainer.train()
    compiled = sum(1 for m in trainer.model.modules() if getattr(m, "_compiled_call_impl", None) is not None)
    lines = (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()
    return compiled, [json.loads(x)["loss"] for x in lines if "event" not in json.loads(x)]


@needs_corpus
def test_trainer_with_compiled_layers_matches_eager(spm_model, tmp_path):
    """The trainer with ``model.compile=true`` (TP = 2, activation checkpointing, dropout 0): every layer
    compiled on every rank, the losses of the eager run."""
    common = {"parallel.tensor": 2, "train.iters": 3, "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
              "model.activation_checkpointing": "true", "optimizer.warmup_iters": 0}
    eager = run_distributed(train_worker, 2, tiny_overrides(spm_model, tmp_path / "eager", **common))
    comp = run_distributed(train_worker, 2, tiny_overrides(spm_model, tmp_path / "compiled", **common,
                                                        **{"model.compile": "true"}))
    assert [c[0] for c in comp] == [2, 2] and eager[0][0] == 0
    torch.testing.assert_close(torch.tensor(comp[0][1]), torch.tensor(eager[0][1]), rtol=1e-5, atol=1e-5)
