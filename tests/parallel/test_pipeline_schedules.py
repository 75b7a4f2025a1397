"""The pipeline schedules of issue 41 (docs/pipeline.md): DeepSpeed's 1F1B, Megatron's interleaved 1F1B
(training.optim.pipe_interleaved) and DeepSpeed's DualPipeV train the same model to the same numbers.

One 2-rank launch builds a 4-layer GPT (hidden 32, sequence 16, fp32, no dropout) four times from the same seed:
PP=1 (two data-parallel replicas fed the same batches, so the step is the single-replica step), PP=2 1F1B, PP=2
interleaved with v=2 (one layer per chunk, the wraparound rank 1 -> rank 0 in use; its messages untagged, each
stream on its own two-rank group, training.optim.pipe_channels) and PP=2 DualPipeV, each for
three steps of four micro-batches and one evaluation batch. Losses (the evaluation's too), every gradient before
each step (per tensor, by GPTModel name, the tied embedding included; the key third of the QKV bias aside, see
``tests.helpers.parity.comparable``) and the weights after the last step (over the whole model, see
``tests.helpers.parity.model_gap``) agree within 1e-6 relative, for GPT-2 and the Llama shape (RoPE, RMSNorm,
SwiGLU, GQA, untied output layer, no biases), and for GPT-2 interleaved and DualPipeV under ZeRO-1 (DeepSpeed's
ZeRO optimizer step); PP=2 1F1B and interleaved in fp16 give the same losses. A 4-rank launch does the same at TP=2:
1F1B and interleaved without sequence parallelism, interleaved and DualPipeV with it, against TP=2 at PP=1 (and the
Llama shape's interleaved and DualPipeV with sequence parallelism against its TP=2 PP=1 run); without
sequence parallelism each TP rank sends its half of every activation and gradient and the receiver all-gathers them
(Megatron's scatter/gather: DeepSpeed's pipe_partitioned under 1F1B, training.parallel.pipe_scatter under
interleaved), with it its sequence chunk; what every rank really sends and gathers is the planner's
(training.plan.timing.comm, counted by tests/helpers/pipe_traffic.py). In the same launch, under emulated CUDA
(DeepSpeed's accelerator claiming cuda:rank, tests/helpers/device_guard.py) every interleaved send, receive and
scatter/gather all-gather at TP=2 has its tensor on the engine's device, as NCCL needs. Stopped interleaved and
DualPipeV runs resume bitwise through the trainer's checkpoints; the interleaved checkpoint is refused in one line
under another schedule, and converted by the reshard tool to DualPipeV it resumes with the interleaved run's losses.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import model_gap, rel_gap
from tests.helpers.pipe_traffic import PipeTraffic
from tests.helpers.training_runs import ROOT, needs_corpus, resume_worker, tiny_overrides, train_stages

VOCAB, STEPS, GAS = 128, 3, 4
SCHEDULES = [(1, "1f1b", 1), (2, "1f1b", 1), (2, "interleaved", 2), (2, "dualpipev", 1)]
FP16 = [(2, "1f1b", 1, False, "fp16"), (2, "interleaved", 2, False, "fp16")]
LLAMA = [(1, "1f1b", 1, False, "fp32", "llama"), (2, "interleaved", 2, False, "fp32", "llama"),
         (2, "dualpipev", 1, False, "fp32", "llama")]
# the Llama shape at TP=2 with sequence parallelism (in the TP=2 launch), against TP=2 x PP=1 with it
LLAMA_TP2_SP = [(1, "1f1b", 1, True, "fp32", "llama"), (2, "interleaved", 2, True, "fp32", "llama"),
                (2, "dualpipev", 1, True, "fp32", "llama")]
# ZeRO-1 (DeepSpeed's ZeRO optimizer: its flat fp32 groups, reduction and step) under the new schedules, against
# PP=1 at ZeRO-0; one data-parallel replica, so its gradients can be named (_zero_grads)
ZERO1 = [SCHEDULES[0], (2, "interleaved", 2, False, "fp32", "gpt2", 1), (2, "dualpipev", 1, False, "fp32", "gpt2", 1)]


def _model_cfg(name: str):
    from training.models.config import ModelConfig

    if name == "gpt2":
        return ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=VOCAB,
                           hidden_dropout=0.0, attention_dropout=0.0)
    model = yaml.safe_load((ROOT / "configs" / "llama_tiny.yaml").read_text())["model"]  # RoPE, RMSNorm, SwiGLU,
    model.update(num_layers=4, seq_length=16, vocab_size=VOCAB)                          # GQA, untied output
    return ModelConfig(**model)


def _train(tp: int, pp: int, schedule: str, v: int, sp: bool = False, dtype: str = "fp32",
           model_name: str = "gpt2", zero: int = 0) -> dict:
    from training.checkpoint_reader import PipeNames, canonical_name
    from training.config import Config
    from training.ds_json import deepspeed_config
    from training.models.gpt2 import GPTModel
    from training.models.gpt2_pipe import build_gpt2_pipe
    from training.optim.adamw import build_optimizer
    from training.optim.engine import build_engine
    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState
    from training.resolve import allow_fp16_on_cpu

    allow_fp16_on_cpu()  # DeepSpeed's fp16 engine on the CPU accelerator (tiny models only)
    cfg = Config()
    cfg.model = _model_cfg(model_name)
    cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.sequence_parallel = tp, pp, sp
    cfg.parallel.pipeline_schedule, cfg.parallel.virtual_pipeline = schedule, v
    cfg.parallel.zero_stage = zero
    ps = ParallelState(tp=tp, pp=pp)
    dp = ps.dims.dp
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.iters = 2, 2 * GAS * dp, STEPS
    cfg.optimizer.lr, cfg.optimizer.warmup_iters = 1e-3, 0
    tp_random.configure(ps, cfg.model.num_layers)
    tp_random.set_seed(1234)
    if pp > 1:
        model = build_gpt2_pipe(cfg.model, VOCAB, ps, seed=1234, sequence_parallel=sp, schedule=schedule,
                                virtual_pipeline=v)
    else:
        model = GPTModel(cfg.model, VOCAB, ps.tp_group, seed=1234, sequence_parallel=sp)
    opt, sched = build_optimizer(model, cfg.optimizer, STEPS)
    engine = build_engine(model, opt, sched, deepspeed_config(cfg, dp, dtype), ps)

    channels = getattr(engine, "channels", None)
    def name(n):
        return canonical_name(n, PipeNames.of(cfg.model)) if pp > 1 else n

    # the last stage's copy of the tied embedding module is skipped: its word embedding is rank 0's (reduced
    # over the tied group), its position table unused there
    names = {id(p): name(n) for n, p in engine.module.named_parameters()
             if not getattr(p, "ds_pipe_replicated", False)}
    grads: list[dict] = []
    hooked = engine.optimizer if dtype == "fp32" and not zero else engine.optimizer.optimizer  # the wrapped AdamW
    if zero:  # ZeRO-1 at one data-parallel replica: AdamW steps each whole flat fp32 group, cut back into tensors
        hooked.register_step_pre_hook(lambda o, *_: _zero_grads(grads, engine.optimizer, o, names))
    else:
        hooked.register_step_pre_hook(lambda o, *_: grads.append(
            {names[id(p)]: p.grad.detach().clone() for grp in o.param_groups for p in grp["params"]
             if p.grad is not None and id(p) in names}))
    # the same batches on every replica and every step (the loss falls)
    gen = torch.Generator().manual_seed(100)
    seqs = torch.randint(0, VOCAB, (GAS, 2, cfg.model.seq_length + 1), generator=gen)
    batches = [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seqs]
    losses = []
    traffic = PipeTraffic()  # what the training steps send stage to stage (tests/helpers/pipe_traffic.py)
    for _ in range(STEPS):
        if pp > 1:
            with traffic:
                losses.append(float(engine.train_batch(data_iter=iter(batches))))
            continue
        step_loss = 0.0
        for tokens, labels in batches:
            loss = engine(tokens, labels).mean()
            engine.backward(loss)
            engine.step()
            step_loss += float(loss.detach()) / GAS
        losses.append(step_loss)
    if pp > 1:  # evaluation: the schedule's forward-only order
        valid = float(engine.eval_batch(data_iter=iter(batches)))
    else:
        with torch.no_grad():
            engine.eval()
            valid = sum(float(engine(t, lab).mean()) for t, lab in batches) / GAS
    weights = {names[id(p)]: p.detach().clone() for p in engine.module.parameters() if id(p) in names}
    # the interleaved engine's untagged p2p groups, one per link
    links = {(lk.kind, lk.sender, lk.receiver): (g.size(), id(g)) for lk, g in channels.groups.items()} if channels else None
    return {"losses": losses, "valid": valid, "grads": grads, "weights": weights, "engine": type(engine).__name__,
            "tp_rank": ps.tp_rank, "links": links,
            "traffic": {"sends": traffic.sends, "gathers": traffic.gathers, "pipe_gathers": traffic.pipe_gathers()}}


def _zero_grads(grads: list[dict], zero_opt, stepped, names: dict) -> None:
    """The gradients DeepSpeed's ZeRO-1 optimizer steps with, by name, into ``grads`` (one dict per step): it steps
    its wrapped optimizer once per parameter group (``stepped``: that group alone), whose fp32 partition (the whole
    flat group at one data-parallel replica, in DeepSpeed's flattening order) is cut back into tensors."""
    (part,) = stepped.param_groups[0]["params"]
    i = [id(q) for q in zero_opt.single_partition_of_fp32_groups].index(id(part))
    params = zero_opt.round_robin_bit16_groups[i]
    assert part.numel() >= sum(p.numel() for p in params), "one replica holds the whole group"
    if i == 0:
        grads.append({})
    at = 0
    for p in params:
        if id(p) in names:
            grads[-1][names[id(p)]] = part.grad[at:at + p.numel()].view_as(p).clone()
        at += p.numel()


def _worker(rank: int, world: int, tp: int, layouts, guarded=None) -> dict:
    """Each layout's run; and ``guarded``'s once more under emulated CUDA (tests/helpers/device_guard.py: DeepSpeed's
    accelerator claiming cuda:rank, every collective's and point-to-point's tensors checked against the engine's
    device)."""
    from tests.helpers.device_guard import emulated_cuda_run

    out = {layout: _train(tp, *layout) for layout in layouts}
    if guarded is not None:
        with emulated_cuda_run(rank) as (guard, _):
            run = _train(tp, *guarded)
        out["guarded"] = {"losses": run["losses"], "seen": dict(guard.seen), "violations": list(guard.violations)}
    return out


def _merged(ranks, layout, key, tp_rank=0):
    """The dicts of ``key`` of TP rank ``tp_rank``'s ranks merged by name (the stages hold different layers; each TP
    rank's shards are compared with the same TP rank's reference)."""
    ranks = [r for r in ranks if r[layout]["tp_rank"] == tp_rank]
    if key == "weights":
        out = {}
        for r in ranks:
            out.update(r[layout]["weights"])
        return [out]
    steps = [{} for _ in ranks[0][layout]["grads"]]
    for r in ranks:
        for merged, step in zip(steps, r[layout]["grads"]):
            merged.update(step)
    return steps


def _loss_gap(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _check_alike(ranks, layouts, tp):
    ref = layouts[0]
    gaps = {}
    for layout in layouts:  # a gradient of every parameter before every step
        steps = _merged(ranks, layout, "grads")
        assert len(steps) == STEPS and all(s.keys() == _merged(ranks, layout, "weights")[0].keys() for s in steps)
    for layout in layouts[1:]:
        loss_gap = _loss_gap(ranks[0][layout]["losses"] + [ranks[0][layout]["valid"]],
                             ranks[0][ref]["losses"] + [ranks[0][ref]["valid"]])
        grad_gap = max(rel_gap(g, r) for t in range(tp)
                       for g, r in zip(_merged(ranks, layout, "grads", t), _merged(ranks, ref, "grads", t)))
        weight_gap = max(model_gap(_merged(ranks, layout, "weights", t)[0], _merged(ranks, ref, "weights", t)[0])
                         for t in range(tp))
        gaps[layout] = (loss_gap, grad_gap, weight_gap)
        assert all(r[layout]["losses"] == ranks[0][layout]["losses"] for r in ranks)  # every stage reports the loss
    print(f"TP={tp} relative gaps to PP=1 (loss, gradient, weights):", gaps)
    assert ranks[0][ref]["losses"][-1] < ranks[0][ref]["losses"][0]  # it trains
    for layout, (loss_gap, grad_gap, weight_gap) in gaps.items():
        assert loss_gap <= 1e-6 and grad_gap <= 1e-6 and weight_gap <= 1e-6, (layout, gaps[layout])


def test_schedules_train_alike_at_pp2():
    ranks = run_distributed(_worker, 2, 1, SCHEDULES + FP16 + LLAMA + ZERO1[1:], timeout=600)
    assert ranks[0][SCHEDULES[2]]["engine"] == "InterleavedPipeEngine"
    assert ranks[0][SCHEDULES[3]]["engine"] == "DualPipeEngine"
    # p = 2: the four streams between the one pair of ranks are four two-rank groups (pipe_channels), no tags
    links = ranks[0][SCHEDULES[2]]["links"]
    assert sorted(links) == [("activation", 0, 1), ("activation", 1, 0), ("gradient", 0, 1), ("gradient", 1, 0)]
    assert {size for size, _ in links.values()} == {2} and len({g for _, g in links.values()}) == 4
    _check_alike(ranks, SCHEDULES, 1)
    _check_alike(ranks, LLAMA, 1)
    assert [ranks[0][z]["engine"] for z in ZERO1[1:]] == ["InterleavedPipeEngine", "DualPipeEngine"]
    _check_alike(ranks, ZERO1, 1)
    # fp16 (the project's MixedPrecisionStep, the loss scale decided on the device): interleaving changes no number
    assert ranks[0][FP16[1]]["losses"] == ranks[0][FP16[0]]["losses"], [ranks[0][x]["losses"] for x in FP16]


def _planned_comm(layout):
    """The planner's stage-to-stage traffic (training.plan.timing.comm) for a PP=2, TP=2 layout of :func:`_train`."""
    from training.layout import Layout
    from training.plan.accounting import ModelShape
    from training.plan.timing import comm

    pp, schedule, v, sp = layout[:4]
    lay = Layout(tp=2, pp=pp, micro_batch=2, global_batch=2 * GAS, sequence_parallel=sp, virtual_pipeline=v,
                 dualpipev=schedule == "dualpipev")
    return comm(ModelShape.from_config(_model_cfg("gpt2"), 2), lay, ckpt=False, dtype="fp32")


def _check_planned_traffic(ranks, layout):
    """Every activation and gradient message each rank really sent has the planner's bytes per send; each pipeline
    all-gather takes one such piece from each rank; and all-gathers come per message as the planner counts them
    (over the pipeline's ranks together: at p = 2 neither is the interior rank the planner counts, and together they
    play its part once per step under 1F1B)."""
    planned = _planned_comm(layout)
    sends = [n for r in ranks for n in r[layout]["traffic"]["sends"]]
    gathers = sum(r[layout]["traffic"]["pipe_gathers"] for r in ranks)
    assert sends and set(sends) == {planned.pp_send_bytes}, (layout, set(sends), planned.pp_send_bytes)
    assert gathers * planned.pp_ops == len(sends) * planned.pp_gather_ops, (layout, gathers, len(sends), planned)
    if not layout[3]:  # without sequence parallelism the TP layers gather nothing: every all-gather is a piece's
        assert all(n == planned.pp_send_bytes for r in ranks for n in r[layout]["traffic"]["gathers"]), layout
    return planned.pp_send_bytes, gathers, len(sends)


def test_schedules_train_alike_with_tp2_and_sequence_parallelism():
    layouts = [(1, "1f1b", 1, False), (2, "1f1b", 1, False), (2, "interleaved", 2, False),
               (2, "interleaved", 2, True), (2, "dualpipev", 1, True)]
    ranks = run_distributed(_worker, 4, 2, layouts + LLAMA_TP2_SP, layouts[2], timeout=1200)
    _check_alike(ranks, layouts, 2)
    _check_alike(ranks, LLAMA_TP2_SP, 2)
    # stage-to-stage messages per TP rank, as the planner counts them: half the [b, s, h] = [2, 16, 32] activation
    # (and its gradient), by Megatron's scatter/gather without sequence parallelism (DeepSpeed's pipe_partitioned
    # under 1F1B, training.parallel.pipe_scatter under interleaved; all-gathered on receipt), by the sequence chunk
    # with it (sent whole, no all-gather)
    traffic = {layout: _check_planned_traffic(ranks, layout) for layout in layouts[1:]}
    print("stage-to-stage bytes per send, pipeline all-gathers, sends (4 ranks, 3 steps):", traffic)
    assert {n for n, _, _ in traffic.values()} == {2 * 16 * 32 * 4 // 2}
    assert [g > 0 for _, g, _ in traffic.values()] == [True, True, False, False]
    # emulated CUDA (tests/helpers/device_guard.py): every send and receive of the interleaved engine at TP = 2 (the
    # groups' warm-up, the metadata, the scattered pieces) and every all-gather of them has its tensor on the
    # engine's device, as NCCL requires; the numbers are the plain run's
    for r in ranks:
        guarded = r["guarded"]
        assert not guarded["violations"], guarded["violations"][:5]
        assert all(guarded["seen"].get(f"torch.distributed.{op}", 0) > 10 for op in ("isend", "irecv", "all_gather"))
        assert guarded["losses"] == r[layouts[2]]["losses"]


def _resume_worker(rank: int, world: int, spec: dict, base: str) -> dict:
    from megatron_ds_suite.core.errors import ConfigError
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    out = {}
    for schedule, v in (("interleaved", 2), ("dualpipev", 1)):
        ov = tiny_overrides(spec, Path(base), **{"parallel.tensor": 1, "parallel.pipeline": 2,
                                                 "parallel.pipeline_schedule": schedule,
                                                 "parallel.virtual_pipeline": v, "model.num_layers": 4,
                                                 "train.iters": 4, "train.log_interval": 1})
        out[schedule] = resume_worker(rank, world, ov, f"{base}/{schedule}")
    # the interleaved checkpoint under another schedule: refused in one line, before any work
    other = tiny_overrides(spec, Path(base), **{"parallel.tensor": 1, "parallel.pipeline": 2, "model.num_layers": 4,
                                                "train.iters": 4, "run.dir": f"{base}/interleaved/part"})
    try:
        Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", other))).train()
        out["refusal"] = None
    except ConfigError as e:
        out["refusal"] = str(e)
    return out


@needs_corpus
def test_stopped_runs_resume_bitwise_under_each_schedule(spm_model, tmp_path):
    ranks = run_distributed(_resume_worker, 2, spm_model, str(tmp_path), timeout=900)
    for schedule in ("interleaved", "dualpipev"):
        full, part = ranks[0][schedule]

        def losses(rows):
            return [(r["iteration"], r["loss"], r["lr"]) for r in rows if "event" not in r]

        assert len(losses(full)) == 4, full
        assert losses(part) == losses(full), (schedule, losses(part), losses(full))  # bitwise: the same floats
    refusal = ranks[0]["refusal"]
    assert refusal is not None and "\n" not in refusal, refusal
    assert "pipeline_schedule=interleaved virtual_pipeline=2" in refusal and "training.tools.reshard" in refusal
    # what the refusal proposes: the interleaved checkpoint of iteration 2 converted to DualPipeV, resumed to 4
    from training.tools.reshard import reshard

    out = tmp_path / "to_dualpipev"
    reshard(tmp_path / "interleaved" / "part", tp=1, pp=2, out=out, tag="iter_0000002", schedule="dualpipev")
    ov = tiny_overrides(spm_model, out, **{"parallel.tensor": 1, "parallel.pipeline": 2, "model.num_layers": 4,
                                           "parallel.pipeline_schedule": "dualpipev", "train.iters": 4,
                                           "train.log_interval": 1})
    run_distributed(train_stages, 2, ov, [[]])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = {r["iteration"]: r["loss"] for r in rows if "event" not in r}  # the rows after the resume win
    full = {r["iteration"]: r["loss"] for r in ranks[0]["interleaved"][0] if "event" not in r}
    for it in (3, 4):
        assert abs(resumed[it] - full[it]) <= 1e-6 * abs(full[it]), (it, resumed[it], full[it])
