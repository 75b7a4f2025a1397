"""The planner's report as text: the per-run tables (:func:`render_plan`) and the paper comparison."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from training.layout import Layout
from training.plan.accounting import ModelShape, recomputed_flops, stage_params, step_flops, total_params
from training.plan.memory import GIB, Memory, memory, state_bytes_per_param
from training.plan.paper import PAPER_BASELINE_TFLOPS, default_compute_fraction, paper_weak_scaling
from training.plan.recompute import choose_recompute
from training.plan.timing import Comm, TimeModel, comm, step_time
from training.runtime.hardware import Hardware, get_hardware


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f}"


def _fmt_bytes(x: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= div:
            return f"{x / div:,.2f} {unit}"
    return f"{x:,.0f} B"


def _fmt_params(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _llama_parts(shape: ModelShape) -> str:
    """The model line's Llama-family options, e.g. ' (GQA 8 kv heads, SwiGLU, RoPE, RMSNorm, untied, no bias)'."""
    parts = []
    if shape.kv_heads is not None and shape.kv_heads != shape.heads:
        parts.append(f"GQA {shape.kv_heads} kv heads")
    if shape.gated:
        parts.append("SwiGLU")
    if not shape.learned_positions:
        parts.append("RoPE")
    if shape.rmsnorm:
        parts.append("RMSNorm")
    if shape.untied:
        parts.append("untied")
    if not shape.bias:
        parts.append("no bias")
    return f" ({', '.join(parts)})" if parts else ""


def _selective_line(shape: ModelShape, lay: Layout, mem: Memory, scores_stored: bool) -> str:
    """What selective recomputation (``model.recompute: selective``) saves and what it recomputes."""
    if not scores_stored:
        return ("  selective recomputation: saves nothing here (fused attention keeps no s^2 scores and "
                "recomputes them in its backward kernel): same as none")
    extra = recomputed_flops(shape, lay.global_batch, "selective")
    full = recomputed_flops(shape, lay.global_batch, "full")
    base = step_flops(shape, lay.global_batch, False)
    return (f"  selective recomputation (attention core): activations {_gib(mem.activations_selective)} GiB, "
            f"saves {_gib(mem.activations - mem.activations_selective)} GiB of {_gib(mem.activations)}; "
            f"recomputes {extra:.4g} FLOPs per step (+{extra / base:.2%}; full: +{full / base:.2%})")


def _zero_table(shape: ModelShape, lay: Layout, dtype: str, scores_stored: bool, cpu: bool) -> list[str]:
    """Per-rank model state for ZeRO stages 0-3 and ZeRO-Offload at this layout's DP degree (the ZeRO paper's
    formulas, :func:`training.plan.memory.zero_state_bytes`), GiB, with the activations without recomputation."""
    rows = [f"model state per rank by ZeRO stage, GiB (DP={lay.dp}; parallel.zero_stage, parallel.offload_optimizer):",
            f"  {'':28s}{'weights':>10s}{'grads':>10s}{'optimizer':>10s}{'host':>10s}{'device':>10s}"]
    for stage, offload in ((0, False), (1, False), (2, False), (3, False), (2, True), (3, True)):
        m = memory(shape, lay, dtype, scores_stored, cpu=cpu, zero_stage=stage, offload=offload)
        z = m.zero
        assert z is not None
        label = f"ZeRO-{stage}" + (" + offload cpu" if offload else "")
        rows.append(f"  {label:28s}{_gib(z.params):>10s}{_gib(z.grads):>10s}{_gib(z.optimizer):>10s}"
                    f"{_gib(z.host_optimizer):>10s}{_gib(m.total_at_stage('none')):>10s}")
    rows.append("  (device = weights + gradients + optimizer states + activations without recomputation)")
    return rows


def render_plan(shape: ModelShape, lay: Layout, hw: Hardware, tm: TimeModel, dtype: str,
                scores_stored: bool = True) -> str:
    """The CLI report as text (tables)."""
    out: list[str] = []
    total = total_params(shape)
    stages = stage_params(shape, lay.tp, lay.pp, lay.dualpipev)
    out.append(f"model: {shape.arch} l={shape.num_layers} h={shape.hidden} a={shape.heads} s={shape.seq} "
               f"V(padded)={shape.vocab:,} ffn={shape.ffn}{_llama_parts(shape)}")
    out.append(f"layout: TP={lay.tp} PP={lay.pp} DP={lay.dp} -> {lay.world} devices of {hw.name} "
               f"({hw.gpus_per_node}/node); micro batch {lay.micro_batch}, global batch {lay.global_batch}, "
               f"{lay.num_micro} micro-batches/step; dtype {dtype}"
               + ("; sequence parallel" if lay.sequence_parallel else "")
               + (f"; interleaved v={lay.virtual_pipeline}" if lay.virtual_pipeline > 1 else "")
               + ("; DualPipeV" if lay.dualpipev else ""))
    out.append("")
    out.append(f"parameters: total {total:,} ({_fmt_params(total)}), "
               + ("untied output layer included" if shape.untied else "tied output embedding counted once"))
    for i, n in enumerate(stages):
        out.append(f"  per device, stage {i}: {n:,} ({_fmt_params(n)})")
    out.append("")
    mem = memory(shape, lay, dtype, scores_stored, cpu=hw.name == "cpu")
    wb, gb, ob = state_bytes_per_param(dtype)
    out.append(f"memory per device, GiB (most loaded stage; {wb}+{gb}+{ob} bytes/param, "
               f"device has {hw.memory_gb:g}):")
    out.append(f"  {'':28s}{'no ckpt':>12s}{'act. ckpt':>12s}")
    out.append(f"  {'weights':28s}{_gib(mem.params):>12s}{_gib(mem.params):>12s}")
    out.append(f"  {'gradients':28s}{_gib(mem.grads):>12s}{_gib(mem.grads):>12s}")
    out.append(f"  {'optimizer states':28s}{_gib(mem.optimizer):>12s}{_gib(mem.optimizer):>12s}")
    out.append(f"  {f'optimizer states, ZeRO-1/{lay.dp}':28s}{_gib(mem.optimizer_zero1):>12s}"
               f"{_gib(mem.optimizer_zero1):>12s}")
    out.append(f"  {'activations':28s}{_gib(mem.activations):>12s}{_gib(mem.activations_ckpt):>12s}")
    if lay.tp > 1 and shape.seq % lay.tp == 0:  # the other parallel.sequence_parallel setting, for comparison
        other = memory(shape, dataclasses.replace(lay, sequence_parallel=not lay.sequence_parallel), dtype,
                       scores_stored, cpu=hw.name == "cpu")
        label = "activations without SP" if lay.sequence_parallel else "activations with SP"
        out.append(f"  {label:28s}{_gib(other.activations):>12s}{_gib(other.activations_ckpt):>12s}")
    over = False
    for zero1 in (False, True):
        label = "total, ZeRO-1" if zero1 else "total"
        vals = [mem.total(zero1, c) for c in (False, True)]
        fits = ["" if hw.memory_gb <= 0 else ("" if v / GIB <= hw.memory_gb else " !") for v in vals]
        over = over or any(fits)
        out.append(f"  {label:28s}{_gib(vals[0]) + fits[0]:>12s}{_gib(vals[1]) + fits[1]:>12s}")
    if over:
        out.append(f"  (! = exceeds the {hw.memory_gb:g} GiB of one {hw.name})")
    out.extend(_zero_table(shape, lay, dtype, scores_stored, hw.name == "cpu"))
    out.append(_selective_line(shape, lay, mem, scores_stored))
    if hw.memory_gb > 0:
        choice = choose_recompute(shape, lay, dtype, hw.memory_gb, scores_stored=scores_stored, cpu=hw.name == "cpu")
        out.append(f"  model.recompute: auto -> {choice.recompute} on {hw.name}: {choice.describe()}")
    out.append("")
    f = default_compute_fraction(hw, tm, dtype)
    out.append(f"per step (compute fraction {f:.3f} of {hw.peak_tflops.get(dtype) or 0:.4g} TFLOP/s peak):")
    out.append(f"  {'':28s}{'no ckpt':>14s}{'act. ckpt':>14s}")
    fl = [step_flops(shape, lay.global_batch, c) for c in (False, True)]
    out.append(f"  {'FLOPs (all devices)':28s}{fl[0]:>14.4g}{fl[1]:>14.4g}")
    cms = [comm(shape, lay, c, dtype) for c in (False, True)]
    rows: list[tuple[str, Callable[[Comm], str]]] = [("TP collectives", lambda c: f"{c.tp_ops:,}"),
            ("TP payload all-reduced", lambda c: _fmt_bytes(c.tp_payload)),
            ("TP bytes sent per device", lambda c: _fmt_bytes(c.tp_wire)),
            ("PP sends", lambda c: f"{c.pp_ops:,}"),
            ("PP bytes per send", lambda c: _fmt_bytes(c.pp_send_bytes)),
            ("PP bytes sent per device", lambda c: _fmt_bytes(c.pp_payload)),
            ("PP all-gathers (scatter)", lambda c: f"{c.pp_gather_ops:,}"),
            ("PP all-gather bytes sent", lambda c: _fmt_bytes(c.pp_gather_wire)),
            ("DP payload (local grads)", lambda c: _fmt_bytes(c.dp_payload)),
            ("DP bytes sent per device", lambda c: _fmt_bytes(c.dp_wire))]
    for label, fn in rows:
        out.append(f"  {label:28s}{fn(cms[0]):>14s}{fn(cms[1]):>14s}")
    can_time = hw.peak_tflops.get(dtype) is not None
    if can_time:
        sts = [step_time(shape, lay, hw, tm, c, dtype, compute_fraction=f) for c in (False, True)]
        out.append(f"  predicted step time, s       {'no ckpt':>14s}{'act. ckpt':>14s}")
        for name in ("compute", "replicated", "tp") + (("cp",) if lay.context > 1 else ()) + ("pp", "bubble", "dp",
                                                                                             "dp_exposed"):
            out.append(f"    {name:26s}{getattr(sts[0], name):>14.4f}{getattr(sts[1], name):>14.4f}")
        out.append(f"    {'total':26s}{sts[0].total:>14.4f}{sts[1].total:>14.4f}")
        out.append(f"    {'hw TFLOP/s per device':26s}{sts[0].tflops_per_device:>14.2f}"
                   f"{sts[1].tflops_per_device:>14.2f}")
        out.append(f"    {'tokens/s (all devices)':26s}{lay.global_batch * shape.seq / sts[0].total:>14,.0f}"
                   f"{lay.global_batch * shape.seq / sts[1].total:>14,.0f}")
    else:
        out.append(f"  (no {dtype} peak for {hw.name}: no step time)")
    if hw.intra_node_gbs is None:
        out.append("  (no link bandwidths for this device: communication time counted as 0)")
    return "\n".join(out)


def render_paper_comparison(hw_kind: str = "v100-32gb", tm: TimeModel | None = None) -> str:
    """Table of paper_weak_scaling; the last columns repeat the prediction with the DP all-reduce fully
    hidden behind backward (dp_overlap = 1), the other end of the overlap range."""
    tm = tm or TimeModel()
    rows = paper_weak_scaling(hw_kind, tm)
    hidden = paper_weak_scaling(hw_kind, dataclasses.replace(tm, dp_overlap=1.0))
    hw = get_hardware(hw_kind)
    f = default_compute_fraction(hw, tm)
    out = [f"weak scaling on {hw.name}: fp16, activation checkpointing, batch 8 per replica, compute fraction "
           f"{f:.4f} (calibrated: 1.2B on 1 GPU = {PAPER_BASELINE_TFLOPS:g} TFLOP/s), DP overlap {tm.dp_overlap:g}",
           f"{'model':7s}{'params':>7s}{'TP':>4s}{'DP':>4s}{'GPUs':>6s}{'step s':>8s}{'compute':>9s}"
           f"{'repl.':>7s}{'TP comm':>9s}{'DP comm':>9s}{'TFLOP/s':>9s}{'pred.':>7s}{'paper':>7s}{'diff':>6s}"
           f"{'pred. DP hidden':>17s}"]
    for r, rh in zip(rows, hidden):
        st = r.time
        extra = f"{rh.efficiency:>10.1%} {(rh.efficiency - rh.paper) * 100:>+5.1f}" if r.dp > 1 else ""
        out.append(f"{r.preset[5:]:7s}{_fmt_params(r.params):>7s}{r.tp:>4d}{r.dp:>4d}{r.gpus:>6d}"
                   f"{st.total:>8.3f}{st.compute:>9.3f}{st.replicated:>7.3f}{st.tp:>9.3f}{st.dp_exposed:>9.3f}"
                   f"{r.tflops:>9.2f}{r.efficiency:>7.1%}{r.paper:>7.0%}{(r.efficiency - r.paper) * 100:>+6.1f}"
                   f"{extra:>17s}")
    return "\n".join(out)
