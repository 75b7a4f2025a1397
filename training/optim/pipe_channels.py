"""The point-to-point channels of the interleaved 1F1B schedule: one process group per message stream, no tags.

A micro-batch's activations flow rank r chunk k -> rank r+1 chunk k, and from rank p-1 chunk k to rank 0 chunk k+1
(the wraparound); gradients flow back the same hops. Each *link* is one kind (activation or gradient) from one
sender stage to one receiver stage: the ring's p activation links (r -> r+1 mod p) and p gradient links
(r+1 mod p -> r). No two streams share a link, not even at p = 2 where one pair of ranks carries all four
(ordinary activations 0 -> 1, wraparound activations 1 -> 0, ordinary gradients 1 -> 0, wraparound gradients
0 -> 1). :class:`PipeChannels` gives every link its own two-rank process group, so each group carries messages in
one direction, of one kind, between two ranks: a FIFO.

Why FIFO order is enough (no tags): every rank runs its forward units in the same (chunk, micro-batch) order,
unit i being micro-batch ``(i // (p v)) p + i % p`` of chunk ``(i // p) % v`` (``InterleavedSchedule.unit``), and
its backward units in the same order with the chunks reversed. On an ordinary link the sender's chunk k feeds the
receiver's chunk k, so both ends walk the same sequence; on the wraparound rank p-1's unit (k, b) feeds rank 0's
(k+1, b), which sits exactly p units later in the same sequence, so the order is kept; gradients likewise in
reverse. The activation metadata (shapes and dtypes, once per chunk) travels on the activation link ahead of that
chunk's first activation, and is received ahead of it, so it keeps the order too. The schedule's ``steps()`` are
checked against this by ``tests/unit/test_pipeline_schedule.py`` (every link's sent sequence equals its received
one, p = 2-4, v = 2-3).

Why it cannot deadlock: a send never waits on the host (``isend``, waited at the end of the step); a receive waits
only for its own message, which is the next one on its link. With sends that never block the sender, the schedule
is deadlock-free (the same test simulates every rank, a receive waiting for its send). On NCCL a posted send
blocks its communicator's stream until the peer posts the matching receive; here that stream belongs to one link,
so it holds back only later messages of the same link, which the receiver takes after this one anyway: no cycle.
Two directions or two kinds between one pair on one communicator (A: send x, recv y; B: send y, recv x) is the
deadlock this layout rules out (``tests/unit/test_pipeline_schedule.py`` shows that one stream per rank pair would
block). What it does assume is that operations on different communicators progress independently: torch's
ProcessGroupNCCL relies on it for any two process groups, and for point-to-point with two peers (one communicator
per pair), as DeepSpeed's own 1F1B engine does; NCCL's documentation does not promise it in general ("Using
multiple NCCL communicators concurrently"). Megatron's batched exchange per schedule step (``batch_isend_irecv``)
does without it, at the price of a lockstep schedule rather than DeepSpeed's instruction stream. The one setting
known to break it is ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware queue for every stream, as Megatron asks for
TP overlap): a send waiting at the head of the queue holds back a receive
behind it, so :func:`check_backend` refuses that one setting.

The groups are created once per engine, by every rank in the same order (``dist.new_group`` is collective over the
world), and warmed up link by link in that order, so each link's communicator exists before the schedule runs (NCCL
creates communicators lazily, and the creation blocks the host until the peer joins: two first sends could
otherwise wait on each other).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ds_suite.core.errors import ConfigError

ACTIVATION, GRADIENT = "activation", "gradient"


@dataclass(frozen=True)
class Link:
    """One message stream: ``kind`` messages from pipeline stage ``sender`` to stage ``receiver``."""

    kind: str
    sender: int
    receiver: int


def next_hop(stage: int, chunk: int, stages: int) -> tuple[int, int]:
    """(stage, chunk) that receives the activations of ``chunk`` on ``stage`` (p-1 wraps to 0, chunk + 1)."""
    return (0, chunk + 1) if stage == stages - 1 else (stage + 1, chunk)


def prev_hop(stage: int, chunk: int, stages: int) -> tuple[int, int]:
    """(stage, chunk) that sends ``chunk`` on ``stage`` its activations (and receives its input gradients)."""
    return (stages - 1, chunk - 1) if stage == 0 else (stage - 1, chunk)


def links(stages: int) -> list[Link]:
    """Every link of a pipeline of ``stages`` ranks, in the order the groups are created."""
    act = [Link(ACTIVATION, s, (s + 1) % stages) for s in range(stages)]
    return act + [Link(GRADIENT, a.receiver, a.sender) for a in act]


def activation_out(stage: int, chunk: int, stages: int) -> tuple[Link, int]:
    """The link ``chunk``'s activations leave ``stage`` by, and the chunk that receives them."""
    to_stage, to_chunk = next_hop(stage, chunk, stages)
    return Link(ACTIVATION, stage, to_stage), to_chunk


def activation_in(stage: int, chunk: int, stages: int) -> tuple[Link, int]:
    """The link ``chunk``'s input activations reach ``stage`` by, and the chunk that sent them."""
    from_stage, from_chunk = prev_hop(stage, chunk, stages)
    return Link(ACTIVATION, from_stage, stage), from_chunk


def gradient_out(stage: int, chunk: int, stages: int) -> tuple[Link, int]:
    """The link the gradients of ``chunk``'s inputs leave ``stage`` by (back the activations' hop), and their chunk."""
    to_stage, to_chunk = prev_hop(stage, chunk, stages)
    return Link(GRADIENT, stage, to_stage), to_chunk


def gradient_in(stage: int, chunk: int, stages: int) -> tuple[Link, int]:
    """The link the gradients of ``chunk``'s outputs reach ``stage`` by, and the chunk that sent them."""
    from_stage, from_chunk = next_hop(stage, chunk, stages)
    return Link(GRADIENT, from_stage, stage), from_chunk


def check_backend(backend: str, environ: Mapping[str, str]) -> None:
    """The one setting the channels cannot run under (module docstring), from the process group's backend and the
    process environment; one line."""
    if backend == "nccl" and environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise ConfigError("parallel.pipeline_schedule=interleaved with CUDA_DEVICE_MAX_CONNECTIONS=1: every stream "
                          "shares one hardware queue, so a waiting send blocks the receives behind it; unset it (or "
                          "set it >= 2) or use pipeline_schedule=1f1b")


class PipeChannels:
    """A two-rank process group per :class:`Link` of this rank's pipeline (module docstring), owned by the engine.

    ``pipelines``: the global ranks of every pipeline, stage by stage (DeepSpeed's ``grid.pipe_groups``), the same
    list on every rank; ``device``: where the warm-up tensor lives (the engine's, as every tensor that meets a
    collective)."""

    def __init__(self, pipelines: list[list[int]], device: torch.device):
        me = dist.get_rank()
        self.groups: dict[Link, dist.ProcessGroup] = {}
        self.ranks: dict[int, int] = {}  # stage -> global rank of this rank's pipeline
        for ranks in pipelines:  # every rank creates every group, in the same order
            for link in links(len(ranks)):
                group = dist.new_group([ranks[link.sender], ranks[link.receiver]])
                if me in ranks:
                    self.groups[link] = group
            if me in ranks:
                self.ranks = dict(enumerate(ranks))
        stage = {rank: s for s, rank in self.ranks.items()}[me]
        for link in self.groups:  # communicators made in one order on every rank (NCCL's are lazy and blocking)
            probe = torch.zeros(1, device=device)
            if link.sender == stage:
                self.isend(probe, link).wait()
            elif link.receiver == stage:
                self.recv(probe, link)

    def isend(self, tensor: torch.Tensor, link: Link):
        """Post ``tensor`` on ``link`` (this rank its sender); the work handle is waited by the caller."""
        return dist.isend(tensor, self.ranks[link.receiver], group=self.groups[link])

    def recv(self, tensor: torch.Tensor, link: Link) -> torch.Tensor:
        """Receive the next message of ``link`` (this rank its receiver) into ``tensor``."""
        dist.irecv(tensor, self.ranks[link.sender], group=self.groups[link]).wait()
        return tensor
