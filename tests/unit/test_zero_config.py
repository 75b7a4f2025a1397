"""ZeRO stages and ZeRO-Offload in the run config (issue 42): what is accepted, what is refused in one line before
any work, and the DeepSpeed JSON derived for them (``training.ds_json``). No process starts."""
from __future__ import annotations

import pytest

from megatron_ds_suite.core.errors import ConfigError
from training.config import load_config
from training.ds_json import deepspeed_config
from training.tracking import check_passthrough

TINY = "configs/gpt2_tiny.yaml"  # parallel.tensor: 2


def _load(*overrides):
    from tests.helpers.training_runs import ROOT

    return load_config(ROOT / TINY, list(overrides))


@pytest.mark.parametrize("overrides,message", [
    (["parallel.zero_stage=4"], r"^parallel.zero_stage=4: 0, 1, 2 or 3$"),
    (["parallel.zero_stage=3", "parallel.pipeline=2", "parallel.tensor=1"],
     r"^parallel.zero_stage=3 with parallel.pipeline=2: DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 only"),
    (["parallel.offload_optimizer=cpu"], r"^parallel.offload_optimizer=cpu with parallel.zero_stage=0 and "
                                         r"parallel.pipeline=1: DeepSpeed offloads optimizer states at ZeRO stage 2 or 3"),
    (["parallel.offload_optimizer=cpu", "parallel.zero_stage=1"], r"^parallel.offload_optimizer=cpu with "
                                                                  r"parallel.zero_stage=1 and"),
    (["parallel.offload_optimizer=cpu", "parallel.zero_stage=1", "parallel.pipeline=2"],
     r"^parallel.offload_optimizer=cpu with parallel.zero_stage=1 and parallel.pipeline=2"),
    (["parallel.offload_optimizer=nvme", "parallel.zero_stage=2"], r"offload_optimizer"),
], ids=["stage-4", "zero3-pp", "offload-zero0", "offload-zero1", "offload-pp", "offload-nvme"])
def test_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        _load(*overrides)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("stage,offload,tp", [(3, "none", 1), (3, "cpu", 1), (3, "none", 2), (2, "cpu", 2),
                                               (2, "none", 1)])
def test_accepted_and_derived(stage, offload, tp):
    cfg = _load(f"parallel.zero_stage={stage}", f"parallel.tensor={tp}", f"parallel.offload_optimizer={offload}")
    ds = deepspeed_config(cfg, 2, "bf16")
    zero = ds["zero_optimization"]
    assert zero["stage"] == stage
    # ZeRO-3: the checkpoint's model file holds whole weights (training.checkpoint gathers them)
    assert zero.get("stage3_gather_16bit_weights_on_model_save", False) == (stage == 3)
    if offload == "cpu":
        assert zero["offload_optimizer"] == {"device": "cpu"} and ds["zero_force_ds_cpu_optimizer"] is False
    else:
        assert "offload_optimizer" not in zero and "zero_force_ds_cpu_optimizer" not in ds


def test_offload_keys_are_owned_by_the_run_config():
    for key, owner in (({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "parallel.offload_optimizer"),
                       ({"zero_force_ds_cpu_optimizer": False}, "parallel.offload_optimizer")):
        with pytest.raises(ConfigError, match=owner):
            check_passthrough(key)
