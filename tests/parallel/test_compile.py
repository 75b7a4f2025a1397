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


def _padding_mask() -> torch.Tensor:
    """[2, 16] BERT padding mask (1 = token): the second sequence ends in 5 padding positions."""
    pad = torch.ones(2, 16, dtype=torch.long)
    pad[1, 11:] = 0
    return pad


def _layer(cfg, group, bert: bool):
    """GPT-2/Llama's causal TransformerLayer, or BERT's bidirectional BertLayer (as BertModel builds it)."""
    from training.models.bert import BertLayer
    from training.models.blocks import TransformerLayer

    return (BertLayer(cfg, group, 1, 0) if bert else TransformerLayer(cfg, group, 1, 0)).train()


def _explain_worker(rank, world, dropout, extra=None, bert=False):
    import torch._dynamo as dynamo

    from training.models.bert import attention_mask
    from training.models.config import ModelConfig
    from training.parallel import random as tp_random
    from training.parallel.mappings import COLLECTIVE_CALLS
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=world)
    tp_random.configure(ps, 2)
    tp_random.set_seed(1)
    out = []
    # BERT: both layer orders (pre-LN, as configs/bert_*.yaml; post-LN, the original BERT), with a padding mask
    for order in (("pre_ln", "post_ln") if bert else ("pre_ln",)):
        cfg = ModelConfig(hidden_size=64, num_attention_heads=4, hidden_dropout=dropout, attention_dropout=dropout,
                          layer_order=order, **(extra or {}))
        layer = _layer(cfg, ps.tp_group, bert)
        x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
        args = (x, attention_mask(_padding_mask())) if bert else (x,)
        COLLECTIVE_CALLS.clear()
        layer(*args)
        eager_calls = dict(COLLECTIVE_CALLS)
        dynamo.reset()
        ex = dynamo.explain(layer)(*args)
        reasons = sorted({r.reason.splitlines()[0] for r in ex.break_reasons})
        out.append((ex.graph_count, ex.graph_break_count, reasons, eager_calls))
    return out


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("world,extra,bert", [(1, None, False), (2, None, False), (1, LLAMA, False),
                                              (2, LLAMA, False), (1, None, True), (2, None, True)],
                         ids=["tp1", "tp2", "llama-tp1", "llama-tp2", "bert-tp1", "bert-tp2"])
def test_one_graph_per_layer(world, extra, bert, dropout):
    """No graph break in a layer at TP = 1 or TP = 2 (dynamo turns gloo's all-reduce into a functional
    collective), GPT-2's block, the Llama block (RoPE, RMSNorm, SwiGLU, GQA, no biases) and BERT's
    bidirectional layer (no causal mask, a [b, 1, 1, s] padding mask, pre-LN and post-LN), with and without
    dropout: attention dropout's model-parallel stream is a traced counter-based mask under compilation
    (``training.parallel.random.model_parallel_dropout``), not a generator fork. The eager layer still counts
    its two forward all-reduces."""
    for results in run_distributed(_explain_worker, world, dropout, extra, bert):
        assert len(results) == (2 if bert else 1)
        for graphs, breaks, reasons, eager_calls in results:
            assert (graphs, breaks) == (1, 0), reasons
            assert eager_calls == ({"all_reduce": 2} if world == 2 else {})


def _checkpointed_graphs_worker(rank, world, bert):
    """Graphs dynamo builds for two compiled layers run the way the trainer runs them under
    ``model.recompute: full``: ``tp_random.checkpoint(layer, x[, mask])`` (DeepSpeed's checkpoint, eager) around
    each compiled layer, forward and backward; dropout 0 and 0.1, without and with the checkpoint."""
    import torch._dynamo as dynamo
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    from training.models.bert import attention_mask
    from training.models.config import ModelConfig
    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=world)
    tp_random.configure(ps, 2)
    tp_random.set_seed(1)
    out = {}
    for dropout in (0.0, 0.1):
        cfg = ModelConfig(hidden_size=64, num_attention_heads=4, num_layers=2, hidden_dropout=dropout,
                          attention_dropout=dropout, recompute="full")
        for ckpt in (False, True):
            layers = [_layer(cfg, ps.tp_group, bert) for _ in range(2)]
            dynamo.reset()
            counters.clear()
            cnt = CompileCounter()  # counts the graphs dynamo hands to the backend (explain's graph_count)
            for layer in layers:
                layer.compile(backend=cnt)
            x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
            extra = (attention_mask(_padding_mask()),) if bert else ()
            y = x
            for layer in layers:
                y = tp_random.checkpoint(layer, y, *extra) if ckpt else layer(y, *extra)
            y.square().mean().backward()
            out[dropout, ckpt] = (cnt.frame_count, sum(counters["graph_break"].values()),
                                  dict(counters["graph_break"]))
    return out


@pytest.mark.parametrize("world,bert", [(1, False), (2, True)], ids=["tp1", "bert-tp2"])
def test_checkpointed_compiled_layers_are_two_graphs(world, bert):
    """Under ``model.recompute: full`` the trainer calls DeepSpeed's checkpoint eagerly around each compiled
    layer (``GPTModel.forward``, ``BertModel.encode``): the checkpoint itself is never traced. Without it, two
    layers are one graph (the second layer reuses the first's). With it, exactly two graphs and no break, with
    and without dropout: the checkpoint's forward runs the layer under ``no_grad``, and the graph is guarded on
    the grad mode (dynamo's recompile log: "GLOBAL_STATE changed: grad_mode"), so dynamo compiles the no-grad
    forward once more (``compile_layers``' docstring); backward's recompute runs with grad enabled and reuses
    the first graph. Neither graph is split: the checkpoint adds a graph, never a break."""
    for r in run_distributed(_checkpointed_graphs_worker, world, bert):
        for dropout in (0.0, 0.1):
            assert r[dropout, False][:2] == (1, 0), r[dropout, False][2]
            assert r[dropout, True][:2] == (2, 0), r[dropout, True][2]


def _streams_worker(rank, world):
    import torch.nn.functional as F

    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=world)
    tp_random.configure(ps, 2)

    @torch.compile(fullgraph=True)
    def draw(x):  # attention dropout (model-parallel stream), then hidden dropout (default stream)
        return tp_random.model_parallel_dropout(x, 0.5), F.dropout(x, 0.5, True)

    x = torch.ones(4, 64, 64)
    out = []
    for seed in (1, 1, 2):
        tp_random.set_seed(seed)
        out.append([t.ne(0) for t in draw(x) + draw(x)])  # two calls: the key advances
    key = torch.tensor(12345)
    eager = tp_random.counter_mask(x.shape, key, 2718 + 7 + rank, 0.1)
    compiled = torch.compile(tp_random.counter_mask, fullgraph=True)(x.shape, key, 2718 + 7 + rank, 0.1)
    return out, eager, compiled


def test_compiled_model_parallel_stream_differs_across_tp_ranks_and_repeats_per_seed():
    """The compiled model-parallel stream keeps the tracker's guarantees: attention masks differ across the TP
    ranks and from one call to the next, the default stream (hidden dropout) stays the same on every TP rank
    after it, the same seed repeats every mask and another seed changes them. The hash's integer arithmetic
    gives the same bits eager and compiled (inductor's C++), with P(keep) = 1 - p."""
    (r0, e0, c0), (r1, e1, c1) = run_distributed(_streams_worker, 2)
    for runs in (r0, r1):
        assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))      # same seed, same masks
        assert not torch.equal(runs[0][0], runs[2][0])                       # another seed, another mask
        assert not torch.equal(runs[0][0], runs[0][2])                       # the key advances per call
    for m0, m1 in zip(r0[0], r1[0]):
        assert m0.float().mean().item() == pytest.approx(0.5, abs=0.02)
    assert not torch.equal(r0[0][0], r1[0][0]) and not torch.equal(r0[0][2], r1[0][2])  # attention: per TP rank
    assert torch.equal(r0[0][1], r1[0][1]) and torch.equal(r0[0][3], r1[0][3])          # hidden: shared
    assert torch.equal(e0, c0) and torch.equal(e1, c1) and not torch.equal(e0, e1)
    assert e0.float().mean().item() == pytest.approx(0.9, abs=0.01)


def _grads_worker(rank, world, runs, extra=None, bert=False):
    from training.models.bert import BertModel
    from training.models.compile_layers import compile_layers
    from training.models.config import ModelConfig
    from training.models.gpt2 import GPTModel
    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=1)
    tp_random.configure(ps, 2)
    out = []
    for compiled, ckpt, p in runs:
        tp_random.set_seed(1)
        cfg = ModelConfig(hidden_size=64, num_attention_heads=4, num_layers=2, hidden_dropout=p, attention_dropout=p,
                          activation_checkpointing=ckpt, seq_length=32, **(extra or {}))
        model = (BertModel(cfg, 128, None, seed=3) if bert else GPTModel(cfg, 128, None, seed=3)).train()
        n = compile_layers(model) if compiled else 0
        tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
        tp_random.set_seed(5)
        if bert:  # MLM + SOP on a padded batch: the second sequence's last 9 positions are padding
            pad = torch.ones(2, 32, dtype=torch.long)
            pad[1, 23:] = 0
            types = (torch.arange(32) >= 16).long().expand(2, 32)
            lm_loss, sop = model(tokens, types, pad, tokens, pad)
            loss = lm_loss.mean() + torch.nn.functional.cross_entropy(sop, torch.tensor([0, 1]))
        else:
            loss = model(tokens, tokens).mean()
        loss.backward()
        out.append((n, loss.detach(), {k: q.grad.clone() for k, q in model.named_parameters()}))
    return out


@pytest.mark.parametrize("extra,bert", [(None, False), (LLAMA, False), (None, True)],
                         ids=["gpt2", "llama", "bert"])
def test_compiled_layers_equal_eager_and_replay_dropout_under_recompute(extra, bert):
    """fp32, dropout 0: compiled (inductor) = eager to 1e-5, with and without activation checkpointing.
    Dropout 0.1: compiled with checkpointing gives bitwise the gradients of compiled without, i.e. recompute
    replays the masks the compiled forward drew. GPT-2's block, the Llama block and BERT's (bidirectional,
    padding mask, MLM + SOP loss; pre-LN as configs/bert_*.yaml, post-LN's one graph: test_one_graph_per_layer)."""
    runs = [(False, False, 0.0), (True, False, 0.0), (True, True, 0.0), (True, False, 0.1), (True, True, 0.1)]
    (_, l0, g0), (n1, l1, g1), (_, l2, g2), (_, l3, g3), (_, l4, g4) = run_distributed(_grads_worker, 1, runs,
                                                                                       extra, bert)[0]
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
    import logging
    from pathlib import Path

    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    said = []  # the trainer's log lines about compiling (rank 0 says it once, before the first step)

    class Collect(logging.Handler):
        def emit(self, record):
            if "compiling" in record.getMessage():
                said.append(record.getMessage())

    handler = Collect(level=logging.INFO)
    log = logging.getLogger("training")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    cfg = load_config(Path(ROOT_CONFIG).resolve(), overrides)
    trainer = Trainer(resolve_run(cfg))
    trainer.train()
    log.removeHandler(handler)
    compiled = sum(1 for m in trainer.model.modules() if getattr(m, "_compiled_call_impl", None) is not None)
    lines = (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()
    return compiled, [json.loads(x)["loss"] for x in lines if "event" not in json.loads(x)], said


def _train_each(rank, world, runs):
    """Rank worker: ``train_worker`` for each overrides list of ``runs``, one after the other."""
    return [train_worker(rank, world, overrides) for overrides in runs]


@needs_corpus
def test_trainer_with_compiled_layers_matches_eager(spm_model, tmp_path):
    """The trainer with ``model.compile=true`` (TP = 2, activation checkpointing, dropout 0): every layer
    compiled on every rank, the losses of the eager run."""
    common = {"parallel.tensor": 2, "train.iters": 3, "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
              "model.activation_checkpointing": "true", "optimizer.warmup_iters": 0}
    ranks = run_distributed(_train_each, 2, [tiny_overrides(spm_model, tmp_path / "eager", **common),  # one launch
                                             tiny_overrides(spm_model, tmp_path / "compiled", **common,
                                                            **{"model.compile": "true"})], timeout=600)
    eager, comp = ([r[i] for r in ranks] for i in range(2))  # per rank, as two launches would return them
    assert [c[0] for c in comp] == [2, 2] and eager[0][0] == 0
    assert len(comp[0][2]) == 1 and comp[1][2] == [] and eager[0][2] == []  # rank 0 says it is compiling, once
    assert comp[0][2][0].startswith("compiling the transformer layers (model.compile): the first step")
    torch.testing.assert_close(torch.tensor(comp[0][1]), torch.tensor(eager[0][1]), rtol=1e-5, atol=1e-5)


@needs_corpus
def test_compiled_stop_and_resume_is_bitwise_identical(spm_model, tmp_path):
    """``model.compile=true`` at TP = 2 with hidden and attention dropout: the compiled model-parallel stream's
    only state is the default generator, which the checkpoint saves, so stop-and-resume repeats every loss."""
    from tests.helpers.training_runs import resume_worker

    over = tiny_overrides(spm_model, tmp_path, **{"train.iters": 4, "parallel.tensor": 2, "model.hidden_dropout": 0.1,
                                              "model.attention_dropout": 0.1, "train.global_batch_size": 4,
                                              "model.compile": "true"})
    full, part = run_distributed(resume_worker, 2, over, str(tmp_path))[0]
    steps = lambda rows: [(r["iteration"], r["loss"]) for r in rows if "event" not in r]  # noqa: E731
    assert steps(full) == steps(part) and len(steps(full)) == 4


def test_cuda_graph_needs_a_gpu():
    """``model.cuda_graph=true`` is refused in one line where there is no CUDA GPU (scripts/gpu_check.sh
    ``--only cuda_graph`` exercises it on one)."""
    from megatron_ds_suite.core.errors import ConfigError
    from training.models.blocks import TransformerLayer
    from training.models.compile_layers import compile_layers
    from training.models.config import ModelConfig

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    layer = TransformerLayer(ModelConfig(hidden_size=64, num_attention_heads=4), None, 1, 0)
    with pytest.raises(ConfigError, match="model.cuda_graph=true captures CUDA graphs: it needs a CUDA GPU"):
        compile_layers(layer, cuda_graph=True)
