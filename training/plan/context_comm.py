"""Context parallelism's traffic per step and its time (the planner's CP term, docs/plan.md).

Per layer and micro-batch, on tokens s/c of the sequence and heads n/t (key/value heads g/t) of the rank:

* **Ulysses** (DeepSpeed's ``DistributedAttention``): four all-to-alls around the attention core in forward
  (q, k, v from sequence-split to head-split, the output back), four in backward (their gradients) and four more
  in the recomputed forward with full checkpointing. An all-to-all of n local bytes sends (c - 1)/c x n and takes
  c - 1 exchange steps.
* **Ring** (``training/parallel/ring_attention.py``, Megatron's load-balanced chunks): c - 1 shifts of the stacked
  keys and values in forward (and again in a recomputed forward), and in backward c - 1 shifts of them plus c of
  their gradient accumulators; every shift moves the whole local K/V. The ring here sends and then computes, so
  none of it overlaps compute.
"""
from __future__ import annotations

from dataclasses import dataclass

from training.layout import Layout
from training.plan.accounting import ModelShape


@dataclass(frozen=True)
class ContextComm:
    """Per device per optimizer step (most loaded stage): ``ops`` collectives or shifts, ``wire`` bytes sent."""

    ops: int
    steps: int
    """Latency-bound exchange steps (an all-to-all over c ranks: c - 1; a shift: 1)."""
    wire: float


def context_comm(shape: ModelShape, lay: Layout, layers: int, ckpt: bool, act_bytes: int) -> ContextComm:
    """What context parallelism sends on one rank holding ``layers`` layers, over the step's m micro-batches;
    zero at c = 1."""
    c = lay.context
    if c <= 1:
        return ContextComm(ops=0, steps=0, wire=0.0)
    hn = shape.hidden // shape.heads
    kv_heads = shape.kv_heads or shape.heads
    tokens = shape.seq // c * lay.micro_batch                      # this rank's tokens of one micro-batch
    q_bytes = tokens * shape.heads // lay.tp * hn * act_bytes     # q, the output and their gradients
    kv_bytes = 2 * tokens * kv_heads // lay.tp * hn * act_bytes   # k and v together
    forwards = 2 if ckpt else 1
    per_micro = lay.num_micro * layers
    if lay.context_impl == "ring":
        shifts = forwards * (c - 1) + (c - 1) + c                  # K/V out, K/V again in backward, dK/dV home
        return ContextComm(ops=per_micro * shifts, steps=per_micro * shifts, wire=per_micro * shifts * kv_bytes)
    local = 2 * q_bytes + kv_bytes                                 # q, k, v in and the output back
    alltoalls = 4 * (forwards + 1)
    return ContextComm(ops=per_micro * alltoalls, steps=per_micro * alltoalls * (c - 1),
                       wire=per_micro * (forwards + 1) * (c - 1) / c * local)


def context_time(cc: ContextComm, alpha: float, bandwidth: float) -> float:
    """Seconds of the CP traffic on the critical path: ``alpha`` per exchange step plus the bytes sent over the
    per-direction ``bandwidth`` (bytes/s)."""
    return cc.steps * alpha + cc.wire / bandwidth
