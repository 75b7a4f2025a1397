"""The Megatron-LM paper's weak-scaling experiment (Shoeybi et al. 2019, Fig. 5) and the V100 calibration.

The compute fraction of the step-time model is calibrated on the paper's own 100% point (the 1.2B model
on one V100 at 39 TFLOP/s); :func:`paper_weak_scaling` then predicts the other points of Figure 5.
"""
from __future__ import annotations

from dataclasses import dataclass

from training.layout import Layout
from training.plan.accounting import total_params
from training.plan.layout import validate
from training.plan.presets import preset_shape
from training.plan.timing import StepTime, TimeModel, step_time
from training.runtime.hardware import Hardware, get_hardware

# The paper's weak-scaling runs: model, TP degree; batch 8 per model replica; DP 64 in the DP runs.
PAPER_WEAK_SCALING: list[tuple[str, int, float, float]] = [
    # preset, tp, paper efficiency TP only (Fig. 5), paper efficiency TP x 64-way DP (Fig. 5)
    ("gpt2-1.2b", 1, 1.00, 0.96),
    ("gpt2-2.5b", 2, 0.95, 0.83),
    ("gpt2-4.2b", 4, 0.82, 0.79),
    ("gpt2-8.3b", 8, 0.77, 0.74),
]
PAPER_BASELINE_TFLOPS = 39.0  # 1.2B GPT-2 on one V100, the paper's 100% point ("30% of peak")


def calibrate_compute_fraction(hw: Hardware, tm: TimeModel, target_tflops: float = PAPER_BASELINE_TFLOPS,
                               preset: str = "gpt2-1.2b", micro_batch: int = 8, ckpt: bool = True,
                               dtype: str = "fp16") -> float:
    """Solve for the fraction f at which the model predicts ``target_tflops`` per device for
    ``preset`` on one device (t = p = d = 1). There the step is FLOPs / (peak f) plus terms that do not
    depend on f (all zero on one device), so f = FLOPs / (peak (FLOPs / target - other))."""
    shape = preset_shape(preset)
    lay = Layout(micro_batch=micro_batch, global_batch=micro_batch, gpus_per_node=hw.gpus_per_node)
    st = step_time(shape, lay, hw, tm, ckpt, dtype, compute_fraction=1.0)
    other = st.total - st.compute
    wanted_total = st.flops_per_device / (target_tflops * 1e12)
    return st.compute / (wanted_total - other)


def default_compute_fraction(hw: Hardware, tm: TimeModel, dtype: str = "fp16") -> float:
    if tm.compute_fraction is not None:
        return tm.compute_fraction
    if hw.name == "v100-32gb" and dtype == "fp16":
        return calibrate_compute_fraction(hw, tm)
    return hw.achievable_fraction


@dataclass(frozen=True)
class ScalingRow:
    preset: str
    tp: int
    dp: int
    gpus: int
    params: int
    tflops: float
    efficiency: float
    paper: float
    time: StepTime


def paper_weak_scaling(hw_kind: str = "v100-32gb", tm: TimeModel | None = None) -> list[ScalingRow]:
    """Predict the paper's weak-scaling experiment (Fig. 5): each preset at its TP degree with batch 8
    per replica, alone (d = 1) and with 64-way DP (global batch 512), fp16 with activation
    checkpointing, efficiency = predicted TFLOP/s per GPU / predicted 1.2B one-GPU TFLOP/s."""
    tm = tm or TimeModel()
    hw = get_hardware(hw_kind)
    f = default_compute_fraction(hw, tm)
    rows: list[ScalingRow] = []
    base: float | None = None
    for dp in (1, 64):
        for preset, tp, paper_tp, paper_dp in PAPER_WEAK_SCALING:
            shape = preset_shape(preset, tp)
            lay = Layout(tp=tp, dp=dp, micro_batch=8, global_batch=8 * dp, gpus_per_node=hw.gpus_per_node)
            validate(shape, lay)
            st = step_time(shape, lay, hw, tm, ckpt=True, dtype="fp16", compute_fraction=f)
            if base is None:
                base = st.tflops_per_device
            rows.append(ScalingRow(preset, tp, dp, lay.world, total_params(shape), st.tflops_per_device,
                                   st.tflops_per_device / base, paper_tp if dp == 1 else paper_dp, st))
    return rows
