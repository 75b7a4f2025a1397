"""Megatron sequence parallelism (``parallel.sequence_parallel``, issue 28 item 3).

1. The sequence-parallel maps and linears against a serial reference on 2 gloo ranks: outputs and every input,
   weight and bias gradient (and :func:`mark_sequence_parallel`'s gradient all-reduce).
2. SP on equals SP off for GPT-2 and the Llama tiny config (RoPE, RMSNorm, SwiGLU, GQA, untied, no biases) on 4
   gloo ranks, under the DeepSpeed engine in fp32 with AdamW for three optimizer steps, in three layouts: TP 4;
   TP 2 x DP 2 with activation checkpointing and gradient accumulation; TP 2 x PP 2 (PipelineEngine) with
   activation checkpointing. Compared: the loss of every step and every gradient the optimizer receives
   (recorded by a step pre-hook, i.e. after DeepSpeed's data-parallel and tied-weight all-reduces), within 1e-6.
   Dropout is off there (with SP each rank draws its chunk's masks from the TP-local stream, so the masks, not
   the math, differ); a separate check runs SP with dropout and checkpointing against SP with dropout alone.
3. The one-line refusals at config load.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]
B, S, H = 2, 8, 12


def _primitives_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from training.parallel.layers import column_parallel_linear, mark_sequence_parallel, row_parallel_linear
    from training.parallel.mappings import (
        COLLECTIVE_CALLS,
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(0)
    full = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731 - same on all ranks
    chunk = lambda t, dim=1: t.chunk(world, dim=dim)[rank]  # noqa: E731
    per_rank = [full(B, S, H) for _ in range(world)]       # rank r's partial sums / upstream gradients
    out: dict = {}

    # g: all-gather forward, reduce-scatter backward (the upstream gradients are partial sums)
    x = full(B, S, H)
    xs = chunk(x).clone().requires_grad_()
    y = gather_from_sequence_parallel_region(xs, group)
    (y * per_rank[rank]).sum().backward()
    out["gather"] = (y - x).abs().max(), (xs.grad - chunk(sum(per_rank))).abs().max()

    # g-bar: reduce-scatter forward, all-gather backward
    p = per_rank[rank].clone().requires_grad_()
    up = [full(B, S // world, H) for _ in range(world)]
    y = reduce_scatter_to_sequence_parallel_region(p, group)
    (y * up[rank]).sum().backward()
    out["reduce_scatter"] = (y - chunk(sum(per_rank))).abs().max(), (p.grad - torch.cat(up, dim=1)).abs().max()

    # scatter of a replicated tensor along dim 0 (position embeddings [s, h]): all-gather backward
    pos = full(S, H).requires_grad_()
    ups = [full(S // world, H) for _ in range(world)]
    y = scatter_to_sequence_parallel_region(pos, group, dim=0)
    (y * ups[rank]).sum().backward()
    out["scatter"] = (y - chunk(pos.detach(), 0)).abs().max(), (pos.grad - torch.cat(ups, 0)).abs().max()

    # column-parallel linear on the sequence chunk vs Y = X W^T + b (serial), gradients of X, W_i, b_i
    fin, fout = H, 4 * world
    x, w, b, gy = full(B, S, fin), full(fout, fin), full(fout), full(B, S, fout)
    xr, wr, br = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    (torch.nn.functional.linear(xr, wr, br) * gy).sum().backward()
    xs = chunk(x).clone().requires_grad_()
    wi, bi = chunk(w, 0).clone().requires_grad_(), chunk(b, 0).clone().requires_grad_()
    COLLECTIVE_CALLS.clear()
    y = column_parallel_linear(xs, wi, bi, group, sequence_parallel=True)
    fwd = dict(COLLECTIVE_CALLS)
    COLLECTIVE_CALLS.clear()
    (y * chunk(gy, 2)).sum().backward()
    ref = torch.nn.functional.linear(x, w, b)
    out["column"] = max((y - chunk(ref, 2)).abs().max(), (xs.grad - chunk(xr.grad)).abs().max(),
                        (wi.grad - chunk(wr.grad, 0)).abs().max(), (bi.grad - chunk(br.grad, 0)).abs().max())
    out["column_calls"] = fwd, dict(COLLECTIVE_CALLS)

    # row-parallel linear: X split by features -> reduce-scatter to the chunk, + b (marked: all-reduced grad)
    x, w, b, gy = full(B, S, 4 * world), full(H, 4 * world), full(H), full(B, S, H)
    xr, wr, br = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    (torch.nn.functional.linear(xr, wr, br) * gy).sum().backward()
    xi, wi = chunk(x, 2).clone().requires_grad_(), chunk(w, 1).clone().requires_grad_()
    bias = torch.nn.Parameter(b.clone())
    mark_sequence_parallel(bias, group)
    mark_sequence_parallel(bias, group)  # idempotent: one all-reduce, not two
    y = row_parallel_linear(xi, wi, bias, group, sequence_parallel=True)
    (y * chunk(gy)).sum().backward()
    ref = torch.nn.functional.linear(x, w, b)
    out["row"] = max((y - chunk(ref)).abs().max(), (xi.grad - chunk(xr.grad, 2)).abs().max(),
                     (wi.grad - chunk(wr.grad, 1)).abs().max(), (bias.grad - br.grad).abs().max())
    return out


def test_sequence_parallel_maps_and_linears_equal_the_serial_reference():
    for r in run_distributed(_primitives_worker, 2):
        for name in ("gather", "reduce_scatter", "scatter"):
            assert max(r[name]) < 1e-12, (name, r[name])
        assert r["column"] < 1e-12 and r["row"] < 1e-12, r
        fwd, bwd = r["column_calls"]
        # forward one all-gather; backward the all-gather again (only the chunk was saved) and one reduce-scatter
        assert fwd == {"all_gather": 1} and bwd == {"all_gather": 1, "reduce_scatter": 1}, r["column_calls"]


def _bert_cfg(layer_order: str):
    from training.models.config import ModelConfig

    return ModelConfig(arch="bert", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                       vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0, layer_order=layer_order)


def _bert_loss_and_grads(model, batch) -> tuple[torch.Tensor, dict]:
    from training.models.bert import bert_loss

    tokens, types, padding, labels, loss_mask, sop = batch
    lm_loss, sop_logits = model(tokens, types, padding, labels, loss_mask)
    loss, _ = bert_loss(lm_loss, sop_logits, sop)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _layers_worker(rank: int, world: int) -> dict:
    """BERT (both layer orders) SP vs off; one GPT-2 layer's collectives with SP; SP dropout under checkpointing."""
    from training.models.bert import BertModel
    from training.models.blocks import TransformerLayer, dropout_on_shard
    from training.models.gpt2 import GPTModel
    from training.parallel import random as tp_random
    from training.parallel.mappings import COLLECTIVE_CALLS, gather_sequence
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=world)
    tp_random.configure(ps, num_layers=2)
    out: dict = {}
    g = torch.Generator().manual_seed(5)
    s = 16
    tokens = torch.randint(0, VOCAB, (2, s), generator=g)
    padding = torch.ones(2, s, dtype=torch.long)
    padding[1, 12:] = 0
    batch = (tokens, torch.randint(0, 2, (2, s), generator=g), padding, torch.randint(0, VOCAB, (2, s), generator=g),
             (torch.rand(2, s, generator=g) < 0.3).long(), torch.tensor([0, 1]))
    for order in ("pre_ln", "post_ln"):
        res = []
        for sp in (False, True):
            model = BertModel(_bert_cfg(order), VOCAB, ps.tp_group, seed=7, sequence_parallel=sp).train()
            res.append(_bert_loss_and_grads(model, batch))
        (loss_off, grads_off), (loss_on, grads_on) = res
        out[f"bert_{order}"] = (abs(loss_on - loss_off).item(),
                                max((grads_on[n] - gr).abs().max().item() for n, gr in grads_off.items()))

    # one GPT-2 layer with SP: collectives per forward and backward
    cfg = _bert_cfg("pre_ln")
    cfg.arch = "gpt2"
    layer = TransformerLayer(cfg, ps.tp_group, 7, 0, sequence_parallel=True)
    x = torch.randn(2, s // world, 32, requires_grad=True)
    COLLECTIVE_CALLS.clear()
    y = layer(x)
    out["fwd"] = dict(COLLECTIVE_CALLS)
    COLLECTIVE_CALLS.clear()
    y.sum().backward()
    out["bwd"] = dict(COLLECTIVE_CALLS)

    # dropout on the sequence chunk: each TP rank draws its own mask, and checkpointing replays it
    tp_random.set_seed(11)
    masks = gather_sequence(dropout_on_shard(torch.ones(2, s // world, 32), None, 0.5, True), ps.tp_group)
    out["masks_differ"] = not torch.equal(*masks.chunk(world, dim=1)[:2])
    cfg.hidden_dropout = cfg.attention_dropout = 0.1
    runs = []
    for ckpt in (False, True):
        cfg.activation_checkpointing = ckpt
        tp_random.set_seed(11)
        model = GPTModel(cfg, VOCAB, ps.tp_group, seed=7, sequence_parallel=True).train()
        loss = model(tokens, batch[3]).mean()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    out["dropout_ckpt"] = (abs(runs[0][0] - runs[1][0]).item(),
                           max((runs[1][1][n] - gr).abs().max().item() for n, gr in runs[0][1].items()))
    return out


def test_bert_layer_collectives_and_dropout_with_sequence_parallelism():
    for r in run_distributed(_layers_worker, 2):
        for order in ("pre_ln", "post_ln"):
            loss_diff, grad_diff = r[f"bert_{order}"]
            assert loss_diff < 1e-6 and grad_diff < 1e-6, (order, r[f"bert_{order}"])
        # forward: g before QKV and the MLP's first linear, g-bar after both projections, no all-reduce; backward:
        # the duals plus the two re-gathers of the saved chunks, and one all-reduce per marked parameter (the
        # two LayerNorms' weight and bias, the two projection biases)
        assert r["fwd"] == {"all_gather": 2, "reduce_scatter": 2}, r["fwd"]
        assert r["bwd"] == {"all_gather": 4, "reduce_scatter": 2, "all_reduce": 6}, r["bwd"]
        assert r["masks_differ"]
        assert r["dropout_ckpt"][0] < 1e-6 and r["dropout_ckpt"][1] < 1e-6, r["dropout_ckpt"]


@pytest.mark.parametrize("overrides,message", [
    (["parallel.tensor=1"], "parallel.sequence_parallel=true needs parallel.tensor > 1"),
    (["model.seq_length=63"], "model.seq_length=63 is not a multiple of parallel.tensor=2"),
])
def test_config_refusals_are_one_line(overrides, message):
    from megatron_ds_suite.core.errors import ConfigError
    from training.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "llama_tiny.yaml", ["parallel.sequence_parallel=true", *overrides])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_pipeline_sends_whole_chunks():
    from training.config import load_config
    from training.ds_json import deepspeed_config

    cfg = load_config(ROOT / "configs" / "llama_tiny.yaml", ["parallel.sequence_parallel=true",
                                                             "parallel.pipeline=2"])
    assert deepspeed_config(cfg, 1, "fp32")["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    cfg = load_config(ROOT / "configs" / "llama_tiny.yaml", ["parallel.pipeline=2"])
    assert "pipeline" not in deepspeed_config(cfg, 1, "fp32")


# --------------------------------------------------------------------------------------------------
# SP on == SP off, whole models under the DeepSpeed engine
# --------------------------------------------------------------------------------------------------
VOCAB = 128
STEPS = 3
LAYOUTS = [  # (tp, pp, activation checkpointing, gradient accumulation)
    (4, 1, False, 1),
    (2, 1, True, 2),
    (2, 2, True, 2),
]


def _model_cfg(name: str):
    from training.models.config import ModelConfig

    if name == "gpt2":
        return ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=VOCAB,
                           hidden_dropout=0.0, attention_dropout=0.0)
    model = yaml.safe_load((ROOT / "configs" / "llama_tiny.yaml").read_text())["model"]
    model.update(num_layers=2, seq_length=16, vocab_size=VOCAB)
    return ModelConfig(**model)


def _train(model_name: str, tp: int, pp: int, ckpt: bool, gas: int, sp: bool) -> dict:

    from training.config import Config
    from training.ds_json import deepspeed_config
    from training.models.blocks import NORMS
    from training.models.gpt2 import GPTModel
    from training.models.gpt2_pipe import build_gpt2_pipe
    from training.optim.adamw import build_optimizer
    from training.optim.engine import build_engine
    from training.parallel import random as tp_random
    from training.parallel.layers import RowParallelLinear
    from training.parallel.state import ParallelState

    cfg = Config()
    cfg.model = _model_cfg(model_name)
    if model_name == "llama" and tp == 4:  # the tiny config's 6 heads in 2 groups split 2 ways at most
        cfg.model.num_attention_heads, cfg.model.num_query_groups = 8, 4
    cfg.model.activation_checkpointing = ckpt
    cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.sequence_parallel = tp, pp, sp
    ps = ParallelState(tp=tp, pp=pp)
    dp = ps.dims.dp
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.iters = 2, 2 * gas * dp, STEPS
    cfg.optimizer.lr, cfg.optimizer.warmup_iters = 1e-3, 0
    tp_random.configure(ps, cfg.model.num_layers)
    tp_random.set_seed(1234)
    if pp > 1:
        model = build_gpt2_pipe(cfg.model, VOCAB, ps, seed=1234, sequence_parallel=sp)
    else:
        model = GPTModel(cfg.model, VOCAB, ps.tp_group, seed=1234, sequence_parallel=sp)
    opt, sched = build_optimizer(model, cfg.optimizer, STEPS)
    engine = build_engine(model, opt, sched, deepspeed_config(cfg, dp, "fp32"), ps)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    seen: list[dict] = []
    engine.optimizer.register_step_pre_hook(lambda o, *_: seen.append(
        {names[id(p)]: p.grad.detach().clone() for grp in o.param_groups for p in grp["params"]
         if p.grad is not None}))
    # each replica its own batch, alike across TP and PP; the same batch every step, so the loss falls
    gen = torch.Generator().manual_seed(100 + ps.dp_rank)
    seqs = torch.randint(0, VOCAB, (gas, 2, cfg.model.seq_length + 1), generator=gen)
    batches = [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seqs]
    losses = []
    for _ in range(STEPS):
        if pp > 1:
            losses.append(float(engine.train_batch(data_iter=iter(batches))))
            continue
        step_loss = 0.0
        for tokens, labels in batches:
            loss = engine(tokens, labels).mean()
            engine.backward(loss)
            engine.step()
            step_loss += float(loss.detach()) / gas
        losses.append(step_loss)
    marked = sorted(n for n, p in engine.module.named_parameters() if getattr(p, "sequence_parallel", False))
    # what must be marked: every norm's parameters and the row-parallel projections' biases
    expected = sorted(f"{m_name}.{n}" for m_name, m in engine.module.named_modules()
                      for n, _ in m.named_parameters(recurse=False)
                      if isinstance(m, NORMS) or (isinstance(m, RowParallelLinear) and n == "bias"))
    return {"losses": losses, "grads": seen, "marked": marked, "expected": expected}


def _equivalence_worker(rank: int, world: int, model_name: str) -> dict:
    out = {}
    for tp, pp, ckpt, gas in LAYOUTS:
        off = _train(model_name, tp, pp, ckpt, gas, sp=False)
        on = _train(model_name, tp, pp, ckpt, gas, sp=True)
        assert off["grads"] and len(off["grads"]) == len(on["grads"]) == STEPS
        grad_diff = [max((on_g[n] - g).abs().max().item() for n, g in off_g.items())
                     for off_g, on_g in zip(off["grads"], on["grads"])]
        assert all(off_g.keys() == on_g.keys() for off_g, on_g in zip(off["grads"], on["grads"]))
        out[(tp, pp)] = {"loss_off": off["losses"], "loss_on": on["losses"], "grad_diff": grad_diff,
                         "grad_max": max(g.abs().max().item() for step in off["grads"] for g in step.values()),
                         "marked": on["marked"], "marked_off": off["marked"], "expected": on["expected"]}
    return out


MODELS = ("gpt2", "llama")


def _equivalence_each(rank: int, world: int, model_names: tuple[str, ...]) -> dict:
    return {name: _equivalence_worker(rank, world, name) for name in model_names}


@pytest.fixture(scope="module")
def equivalence() -> list[dict]:
    """Per rank, {model name: ``_equivalence_worker``'s results}: both models in one 4-rank launch."""
    return run_distributed(_equivalence_each, 4, MODELS, timeout=900 * len(MODELS))


@pytest.mark.parametrize("model_name", MODELS)
def test_sequence_parallel_equals_tensor_parallel(equivalence, model_name):
    ranks = [r[model_name] for r in equivalence]
    for r in ranks:
        for layout, res in r.items():
            assert res["loss_on"] == pytest.approx(res["loss_off"], abs=1e-6), (layout, res)
            assert res["loss_off"][-1] < res["loss_off"][0], (layout, res)  # it trains
            assert max(res["grad_diff"]) < 1e-6, (layout, res["grad_diff"], res["grad_max"])
            assert not res["marked_off"] and res["marked"], layout
            assert res["marked"] == res["expected"], res


def test_planner_sequence_parallel_terms():
    """The planner's activation memory with SP is the paper's sbh/t (34 + 5as/h) (16-bit, eq. 4) where without
    it is sbh (10 + 24/t + 5as/(ht)); the report shows both; SP at TP 1 is refused in one line."""
    from megatron_ds_suite.core.errors import ConfigError
    from training.layout import Layout
    from training.plan.accounting import ModelShape
    from training.plan.layout import validate
    from training.plan.memory import activation_bytes_per_layer
    from training.plan.presets import preset_shape
    from training.plan.report import render_plan
    from training.plan.timing import TimeModel
    from training.runtime.hardware import get_hardware

    s, b, h, a, t = 2048, 1, 3072, 32, 8
    shape = ModelShape(arch="gpt2", num_layers=72, hidden=h, heads=a, seq=s, vocab=51200, positions=s, ffn=4 * h)
    assert activation_bytes_per_layer(shape, b, t, sequence_parallel=True) == pytest.approx(
        s * b * h / t * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(shape, b, t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    shape = preset_shape("gpt2-8.3b")
    text = render_plan(shape, Layout(tp=8, micro_batch=4, global_batch=8, sequence_parallel=True),
                       get_hardware("a100"), TimeModel(), "fp16")
    assert "sequence parallel" in text and "activations without SP" in text
    with pytest.raises(ConfigError, match="sequence parallelism needs --tp > 1"):
        validate(shape, Layout(tp=1, sequence_parallel=True))


# --------------------------------------------------------------------------------------------------
# The trainer: config -> task -> fp16 engine with our optimizer step, on emulated CUDA with the collective guard
# --------------------------------------------------------------------------------------------------
def _trainer_worker(rank: int, world: int, work: str) -> dict:
    import json

    from tests.helpers.device_guard import emulated_cuda_run
    from tests.helpers.distributed import SHARED_DATA
    from training.config import load_config
    from training.resolve import allow_fp16_on_cpu, resolve_run
    from training.trainer import Trainer

    allow_fp16_on_cpu()  # before the accelerator is made to report cuda: DeepSpeed's CPU one then runs fp16
    gpt2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"
    out = {}
    for sp, documents in ((False, False), (True, False), (False, True), (True, True)):
        ov = {"data.corpus": "null", "data.text_files": f"[{Path(SHARED_DATA) / 'corpus' / 'botchan.txt'}]",
              "data.tokenizer": json.dumps({"kind": "gpt2_bpe", "vocab_file": str(gpt2 / "gpt2-vocab.json"),
                                            "merges_file": str(gpt2 / "gpt2-merges.txt")}),
              "train.progress_bar": "false", "model.seq_length": "32",
              "model.hidden_dropout": "0.0", "model.attention_dropout": "0.0", "train.micro_batch_size": "2",
              "train.global_batch_size": "4", "train.iters": "3", "train.eval_interval": "0",
              "train.eval_iters": "1", "precision.dtype": "fp16", "parallel.tensor": "2",
              "parallel.sequence_parallel": str(sp).lower(), "optimizer.warmup_iters": "0",
              "run.device_peak_tflops": "1.0", "run.dir": f"{work}/sp{int(sp)}-doc{int(documents)}"}
        if documents:  # packed documents kept apart (training/data/documents.py): the masks made on the device
            ov.update({f"data.{k}": "true" for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")})
        with emulated_cuda_run(rank) as (guard, _):
            trainer = Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", [f"{k}={v}" for k, v in ov.items()])))
            losses = [trainer.train_step()["loss"] for _ in range(3)]
            out[sp, documents] = {"losses": losses, "o1_step": trainer.o1_step, "violations": list(guard.violations),
                       "seen": sum(guard.seen.values()),
                       "marked": sum(getattr(p, "sequence_parallel", False) for p in trainer.model.parameters())}
    return out


def test_trainer_fp16_engine_with_sequence_parallelism(tmp_path):
    data = Path(__file__).resolve().parents[3] / "shared" / "data"
    if not (data / "tokenizers" / "gpt2").exists() or not (data / "corpus" / "botchan.txt").exists():
        pytest.skip("../shared/data (GPT-2 tokenizer, botchan.txt) not present")
    for r in run_distributed(_trainer_worker, 2, str(tmp_path)):
        for documents in (False, True):  # with packed documents kept apart too (data.reset_* and eod_mask_loss)
            off, on = r[False, documents], r[True, documents]
            assert off["o1_step"] and on["o1_step"]  # fp16 at ZeRO-0: training/optim/mixed_precision.py
            assert not on["violations"] and not off["violations"] and on["seen"] > 0, on["violations"]
            # 2 layers x (2 LayerNorms x 2 + 2 projection biases) + the final LayerNorm's 2
            assert off["marked"] == 0 and on["marked"] == 14
            # fp16 on both sides: the same steps up to fp16 rounding of different summation orders
            assert on["losses"] == pytest.approx(off["losses"], rel=2e-3), (on["losses"], off["losses"])
            assert on["losses"][-1] < on["losses"][0]
        # the masks act (at initialization every loss is near ln V, so only an inequality is asserted; a batch with
        # no end of document inside its samples gives the same loss either way)
        assert r[True, True]["losses"] != r[True, False]["losses"]
