"""DeepSpeed's dynamic loss scale at ZeRO-0, as a function of its state.

The state is the wrapper's ``loss_scale_config`` (``cur_scale``, ``cur_iter``, ``last_overflow_iter``,
``scale_factor``, ``scale_window``, ``min_loss_scale``): what DeepSpeed's ``FP16_Optimizer`` and
``FP16_UnfusedOptimizer`` save in a checkpoint and load on resume, so a run resumes with the same scale whichever
step wrote it. The rule is theirs (0.19, ``_update_scale``): an overflow divides the scale by ``scale_factor`` (not
below ``min_loss_scale``) and restarts the window; the scale grows by ``scale_factor`` after every
``scale_window`` applied steps since the last overflow. These ZeRO-0 wrappers have no hysteresis (ZeRO's
``DynamicLossScaler`` does; a ``hysteresis`` setting does not reach them).
"""
from __future__ import annotations


def update_loss_scale(state, overflow: bool) -> None:
    """Advance ``state`` (a DeepSpeed ``loss_scale_config``) by one step that overflowed or not."""
    if state.dynamic_loss_scale:
        if overflow:
            state.cur_scale = max(state.cur_scale / state.scale_factor, state.min_loss_scale)
            state.last_overflow_iter = state.cur_iter
        else:
            stable = state.cur_iter - state.last_overflow_iter - 1  # applied steps since the last overflow
            if stable > 0 and stable % state.scale_window == 0:
                state.cur_scale *= state.scale_factor
    state.cur_iter += 1
