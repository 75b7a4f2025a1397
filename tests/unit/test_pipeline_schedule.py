"""Pipeline schedules without processes (issue 41): the config's one-line refusals, and Megatron's interleaved
order (training.optim.pipe_interleaved.InterleavedSchedule) run as a simulation of p ranks exchanging messages:
every unit runs once, every receive is matched by a send, and no layout deadlocks; and the order argument of the
untagged channels (training.optim.pipe_channels): on every link the receiver takes the messages in the order the
sender sends them."""
from __future__ import annotations

from collections import defaultdict

import pytest
from deepspeed.runtime.pipe import schedule as ds_schedule

from megatron_ds_suite.core.errors import ConfigError
from training.config import Config, validate_static
from training.ds_json import deepspeed_config
from training.layout import Layout
from training.models.config import stage_layers
from training.optim.pipe_channels import activation_in, activation_out, check_backend, gradient_in, gradient_out, links
from training.optim.pipe_interleaved import InterleavedSchedule
from training.parallel_config import check_micro_batches
from training.plan.accounting import head_params, layer_params, stage_params
from training.plan.memory import micro_batches_in_flight, stage_activation_bytes
from training.plan.presets import preset_shape
from training.plan.timing import TimeModel, bubble_fraction, comm, step_time
from training.runtime.hardware import get_hardware


def _cfg(**parallel) -> Config:
    cfg = Config()
    cfg.model.num_layers = parallel.pop("layers", 8)
    cfg.model.arch = parallel.pop("arch", "gpt")
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


@pytest.mark.parametrize("parallel, words", [
    (dict(pipeline=2, pipeline_schedule="interleaved", virtual_pipeline=1), "virtual_pipeline >= 2"),
    (dict(pipeline=1, pipeline_schedule="interleaved", virtual_pipeline=2), "parallel.pipeline >= 2"),
    (dict(pipeline=1, pipeline_schedule="dualpipev"), "parallel.pipeline >= 2"),
    (dict(pipeline=2, virtual_pipeline=2), "needs parallel.pipeline_schedule=interleaved"),
    (dict(pipeline=2, pipeline_schedule="interleaved", virtual_pipeline=0), "virtual_pipeline must be >= 1"),
    (dict(layers=6, pipeline=2, pipeline_schedule="interleaved", virtual_pipeline=2), "4 equal groups"),
    (dict(layers=6, pipeline=2, pipeline_schedule="dualpipev"), "2 stages per rank"),
    # ZeRO-2/3 with any pipeline (DeepSpeed's pipeline engine runs stages 0-1)
    (dict(pipeline=2, pipeline_schedule="interleaved", virtual_pipeline=2, zero_stage=2), "zero_stage=1"),
    # BERT under the schedule's own rules (it runs every schedule)
    (dict(layers=6, pipeline=2, pipeline_schedule="dualpipev", arch="bert"), "2 stages per rank"),
])
def test_bad_schedules_are_refused_in_one_line(parallel, words):
    with pytest.raises(ConfigError) as e:
        validate_static(_cfg(**parallel))
    assert words in str(e.value).replace("BERT", "bert") and "\n" not in str(e.value), str(e.value)


def test_micro_batch_rules():
    inter = _cfg(pipeline=2, pipeline_schedule="interleaved", virtual_pipeline=2)
    dual = _cfg(pipeline=2, pipeline_schedule="dualpipev")
    validate_static(inter)
    validate_static(dual)
    for sched, v in (("interleaved", 2), ("dualpipev", 1)):  # BERT and ZeRO-1 run the new schedules
        validate_static(_cfg(arch="bert", pipeline=2, pipeline_schedule=sched, virtual_pipeline=v))
        validate_static(_cfg(pipeline=2, pipeline_schedule=sched, virtual_pipeline=v, zero_stage=1))
    check_micro_batches(inter.parallel, 4)
    check_micro_batches(dual.parallel, 4)
    with pytest.raises(ConfigError, match="multiple of parallel.pipeline=2"):
        check_micro_batches(inter.parallel, 3)
    with pytest.raises(ConfigError, match="at least 2 x parallel.pipeline = 4"):
        check_micro_batches(dual.parallel, 3)
    inter.train.micro_batch_size, inter.train.global_batch_size = 2, 6  # 3 micro-batches at DP=1
    with pytest.raises(ConfigError, match="multiple of"):
        deepspeed_config(inter, 1, "fp32")
    # the new schedules send whole activations: DeepSpeed's partitioned sends off
    inter.train.global_batch_size = 8
    assert deepspeed_config(inter, 1, "fp32")["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}


def _messages(p: int, m: int, r: int, cmd) -> tuple[tuple | None, tuple | None]:
    """(the message ``cmd`` on rank r waits for, the message it sends), each (kind, receiving rank, chunk,
    micro-batch); rank p-1's chunk k feeds rank 0's chunk k+1."""
    c = getattr(cmd, "chunk", None)
    b = cmd.buffer_id - c * m if c is not None else None
    if isinstance(cmd, ds_schedule.RecvActivation):
        return ("act", r, c, b), None
    if isinstance(cmd, ds_schedule.RecvGrad):
        return ("grad", r, c, b), None
    if isinstance(cmd, ds_schedule.SendActivation):
        return None, ("act", *((0, c + 1) if r == p - 1 else (r + 1, c)), b)
    if isinstance(cmd, ds_schedule.SendGrad):
        return None, ("grad", *((p - 1, c - 1) if r == 0 else (r - 1, c)), b)
    return None, None


def _simulate(p: int, v: int, m: int) -> dict:
    """Run every rank's instructions as far as it can, round after round; a receive waits for its send."""
    programs = [[cmd for step in InterleavedSchedule(m, p, r, v).steps() for cmd in step] for r in range(p)]
    pos, sent, ran = [0] * p, set(), {r: [] for r in range(p)}
    while any(pos[r] < len(programs[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(programs[r]):
                cmd = programs[r][pos[r]]
                needs, gives = _messages(p, m, r, cmd)
                if needs is not None and needs not in sent:
                    break
                sent.add(gives)
                if isinstance(cmd, (ds_schedule.ForwardPass, ds_schedule.BackwardPass, ds_schedule.LoadMicroBatch)):
                    ran[r].append((type(cmd).__name__, cmd.chunk, cmd.buffer_id - cmd.chunk * m))
                pos[r] += 1
                progressed = True
        assert progressed, f"p={p} v={v} m={m}: deadlock at {[programs[r][pos[r]] for r in range(p)]}"
    return ran


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 2, 8), (3, 4, 9)])
def test_interleaved_order_runs_every_unit_once_without_deadlock(p, v, m):
    ran = _simulate(p, v, m)
    units = {(c, b) for c in range(v) for b in range(m)}
    for r, ops in ran.items():
        fwd = [(c, b) for kind, c, b in ops if kind == "ForwardPass"]
        bwd = [(c, b) for kind, c, b in ops if kind == "BackwardPass"]
        assert sorted(fwd) == sorted(units) and sorted(bwd) == sorted(units)
        assert all(ops.index(("ForwardPass", *u)) < ops.index(("BackwardPass", *u)) for u in units)
        # the data iterator is read in micro-batch order: by rank 0 for chunk 0, by rank p-1 for chunk v-1
        loads = [(c, b) for kind, c, b in ops if kind == "LoadMicroBatch"]
        expected = ([(0, b) for b in range(m)] if r == 0 else []) + ([(v - 1, b) for b in range(m)] if r == p - 1 else [])
        assert loads == expected, (r, loads)
    # Megatron's warm-up: rank r runs (p - r - 1) 2 + (v - 1) p forwards (all v m when m == p), then the steady
    # state's forward, before its first backward
    for r in range(p):
        first_bwd = next(i for i, (kind, *_) in enumerate(k for k in ran[r] if k[0] != "LoadMicroBatch")
                         if kind == "BackwardPass")
        warmup = v * m if m == p else min(v * m, (p - r - 1) * 2 + (v - 1) * p)
        assert first_bwd == warmup + (warmup < v * m), (r, first_bwd, warmup)


def _p2p_ops(p: int, v: int, m: int, forward_only: bool = False) -> list[list[tuple]]:
    """Each rank's sends and receives in program order, as (op, link, message), every message named by the (chunk,
    micro-batch) that receives it; the activation metadata goes once per chunk ahead of the chunk's first
    activation (the engine's rule)."""
    ops = []
    for r in range(p):
        mine, meta_out, meta_in = [], set(), set()
        for cmd in (c for step in InterleavedSchedule(m, p, r, v, forward_only).steps() for c in step):
            c = getattr(cmd, "chunk", None)
            b = cmd.buffer_id - c * m if c is not None else None
            if isinstance(cmd, ds_schedule.SendActivation):
                link, to_chunk = activation_out(r, c, p)
                if c not in meta_out:
                    meta_out.add(c)
                    mine.append(("send", link, ("meta", to_chunk)))
                mine.append(("send", link, ("activation", to_chunk, b)))
            elif isinstance(cmd, ds_schedule.RecvActivation):
                link, _ = activation_in(r, c, p)
                if c not in meta_in:
                    meta_in.add(c)
                    mine.append(("recv", link, ("meta", c)))
                mine.append(("recv", link, ("activation", c, b)))
            elif isinstance(cmd, ds_schedule.SendGrad):
                link, to_chunk = gradient_out(r, c, p)
                mine.append(("send", link, ("gradient", to_chunk, b)))
            elif isinstance(cmd, ds_schedule.RecvGrad):
                link, _ = gradient_in(r, c, p)
                mine.append(("recv", link, ("gradient", c, b)))
        ops.append(mine)
    return ops


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_every_link_receives_in_the_order_it_sends(p, v, groups):
    """The untagged channels' order argument: for each link (kind, sender, receiver), one process group, the
    sequence of messages sent equals the sequence received, for training and for evaluation (forward only); the
    links used are pipe_channels.links (2p; evaluation sends no gradient)."""
    m = groups * p
    for forward_only in (False, True):
        sent, received = defaultdict(list), defaultdict(list)
        for r, mine in enumerate(_p2p_ops(p, v, m, forward_only)):
            for op, link, msg in mine:
                assert (link.sender if op == "send" else link.receiver) == r and msg[0] in (link.kind, "meta")
                (sent if op == "send" else received)[link].append(msg)
        assert set(sent) == set(received) == {lk for lk in links(p) if not (forward_only and lk.kind == "gradient")}
        for link in sent:
            assert sent[link] == received[link], (p, v, m, forward_only, link)


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (2, 3, 6), (4, 2, 8)])
def test_one_stream_per_rank_pair_would_block(p, v, m):
    """Why each stream needs its own group: with one NCCL stream per pair of ranks (both directions, both kinds),
    each operation waits for the peer's matching one at the head of the peer's stream; the two ranks' sequences are
    not mirror images (a send facing a send), so that stream stops. Per link they trivially are."""
    ops = _p2p_ops(p, v, m)

    def stream(r, on):  # rank r's operations on one stream, in program order
        return [(op, msg) for op, link, msg in ops[r] if on(link)]

    def mirrored(a, b):
        return [("recv" if op == "send" else "send", msg) for op, msg in a] == b

    def pair(link):
        return {link.sender, link.receiver} == {0, 1}

    assert not mirrored(stream(0, pair), stream(1, pair))
    for one in links(p):
        assert mirrored(stream(one.sender, lambda link: link == one), stream(one.receiver, lambda link: link == one))


def test_nccl_is_refused_only_with_one_device_connection():
    for backend, env in (("gloo", {}), ("nccl", {}), ("nccl", {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}),
                         ("gloo", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})):
        check_backend(backend, env)
    with pytest.raises(ConfigError) as e:
        check_backend("nccl", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in str(e.value) and "\n" not in str(e.value)


def test_planner_counts_the_chunks():
    """The planner's interleaved step: 1/v of the bubble, v times the sends, more activations in flight (Megatron's
    warm-up: rank 0 of p = 4, v = 2, m = 8 holds 11 chunk forwards, 5.5 stages' worth, against 1F1B's 4)."""
    hw, tm, s = get_hardware("v100"), TimeModel(compute_fraction=0.5), preset_shape("gpt2-1.2b")
    one, two = (Layout(pp=4, micro_batch=1, global_batch=8, gpus_per_node=16, virtual_pipeline=v) for v in (1, 2))
    assert micro_batches_in_flight(one, 0) == 4 and micro_batches_in_flight(two, 0) == 5.5
    assert micro_batches_in_flight(two, 3) == ((2 - 1) * 4 + 1) / 2  # the last rank: (v - 1) p + 1 chunks
    t1, t2 = step_time(s, one, hw, tm), step_time(s, two, hw, tm)
    assert t2.bubble == pytest.approx(t1.bubble / 2) and t2.pp == pytest.approx(2 * t1.pp)
    assert comm(s, two, ckpt=True).pp_ops == 2 * comm(s, one, ckpt=True).pp_ops
    assert stage_activation_bytes(s, two, 0, ckpt=False) > stage_activation_bytes(s, one, 0, ckpt=False)


class _DualPipeVRun:
    """DeepSpeed's ``DualPipeVSchedule`` run as a simulation: each rank's clock with a stage forward ``f`` and
    backward ``b``, and its peak of stage forwards whose backward has not run. A ``CommitP2P`` posts the sends
    queued since the last one when the rank reaches it and waits for the queued receives' messages (its batch of
    isend/irecv); compute costs time, communication none."""

    def __init__(self, p: int, m: int, f: float, b: float):
        self.p, self.m, self.f, self.b = p, m, f, b
        self.clock, self.peaks, self.alive = [0.0] * p, [0] * p, [0] * p
        self.ready: dict[tuple, float] = {}
        self.queued: list[tuple[list, list]] = [([], []) for _ in range(p)]

    def message(self, r, cmd, send):  # (activation?, phase, receiving rank, micro-batch)
        act, phase = isinstance(cmd, (ds_schedule.SendActivation, ds_schedule.RecvActivation)), cmd.phase
        down = act == (phase == 0)  # phase-0 activations and phase-1 gradients go to the next rank
        return act, phase, (r + 1 if down else r - 1) if send else r, cmd.buffer_id - phase * self.m

    def run(self, r, cmd) -> bool:
        """Run ``cmd`` on rank r; False when it waits for a message not yet sent."""
        if isinstance(cmd, (ds_schedule.SendActivation, ds_schedule.SendGrad)):
            self.queued[r][0].append(self.message(r, cmd, True))
        elif isinstance(cmd, (ds_schedule.RecvActivation, ds_schedule.RecvGrad)):
            self.queued[r][1].append(self.message(r, cmd, False))
        elif isinstance(cmd, ds_schedule.CommitP2P):
            sends, recvs = self.queued[r]
            for msg in sends:
                self.ready.setdefault(msg, self.clock[r])
            if any(msg not in self.ready for msg in recvs):
                return False
            self.clock[r] = max([self.clock[r]] + [self.ready[msg] for msg in recvs])
            self.queued[r] = ([], [])
        elif isinstance(cmd, (ds_schedule.ForwardPass, ds_schedule.BackwardPass)):
            forward = isinstance(cmd, ds_schedule.ForwardPass)
            self.clock[r] += self.f if forward else self.b
            self.alive[r] += 1 if forward else -1
            self.peaks[r] = max(self.peaks[r], self.alive[r])
        return True

    def span(self) -> float:
        """The step's makespan."""
        programs = [[c for step in ds_schedule.DualPipeVSchedule(self.m, self.p, r).steps() for c in step]
                    for r in range(self.p)]
        pos = [0] * self.p
        while any(pos[r] < len(programs[r]) for r in range(self.p)):
            moved = False
            for r in range(self.p):
                while pos[r] < len(programs[r]) and self.run(r, programs[r][pos[r]]):
                    pos[r] += 1
                    moved = True
            assert moved, f"DualPipeV p={self.p} m={self.m}: deadlock"
        return max(self.clock)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("groups", [2, 3])
def test_planner_models_dualpipev_as_deepspeed_runs_it(p, groups):
    """The planner's DualPipeV (Layout.dualpipev): its bubble is what DeepSpeed's schedule leaves idle with a
    backward twice the forward, below 1F1B's, and its activations in flight are the schedule's peak on every rank
    (2p + 1 stage forwards of l/(2p) layers)."""
    m = groups * p
    lay = Layout(pp=p, micro_batch=1, global_batch=m, dualpipev=True)
    sim = _DualPipeVRun(p, m, 1.0, 2.0)
    span, peaks = sim.span(), sim.peaks
    work = 2 * m * 3.0  # two stages' forward and backward for each micro-batch
    assert (span - work) / work == pytest.approx(bubble_fraction(lay))
    assert bubble_fraction(lay) < bubble_fraction(Layout(pp=p, micro_batch=1, global_batch=m))
    assert [2 * micro_batches_in_flight(lay, r) for r in range(p)] == peaks
    shape = preset_shape("gpt2-1.2b")
    assert comm(shape, lay, ckpt=True).pp_ops == 4 * m  # both stages send, each way
    # rank 0 holds both ends, the tied embedding once; the other ranks their layers only
    one, dual = stage_params(shape, 1, p), stage_params(shape, 1, p, dualpipev=True)
    layers = [n * layer_params(shape, 1) for n in stage_layers(shape.num_layers, p)]
    assert dual[0] == one[0] + head_params(shape, 1) and dual[1:] == layers[1:] and one[-1] > layers[-1]
