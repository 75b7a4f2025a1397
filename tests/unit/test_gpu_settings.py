"""GPU-grade settings chosen by device type (checked on CPU), the batch mover, and backward-path
placement on the ``meta`` device (autograd works there, unlike on fake CUDA tensors)."""
from __future__ import annotations

import inspect
from collections import namedtuple

import pytest
import torch

from training.runtime import device as tdev
from training.runtime.gpu_settings import DeviceSettings, settings_for


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_cuda_gets_torch_fused_adamw_nccl_set_device_and_causal_sdpa(dtype):
    """torch's fused AdamW in every dtype: its found_inf lets the fp16 step decide a skip on the device."""
    assert settings_for("cuda", dtype) == DeviceSettings("torch_fused_adamw", "nccl", True, "sdpa_is_causal", "fp16")


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_cpu_stays_on_the_cpu_path(dtype):
    assert settings_for("cpu", dtype) == DeviceSettings(
        "torch_fused_adamw", "gloo", False, "cpu_fused", "fp32")


def test_unknown_device_type_is_one_clear_error():
    with pytest.raises(ValueError, match="unsupported device type 'mps'"):
        settings_for("mps")


def test_auto_dtype_matches_the_config_resolution():
    from training.config import Config, resolve_dtype

    cfg = Config()
    cfg.precision.dtype = "auto"
    assert resolve_dtype(cfg, on_gpu=True) == settings_for("cuda").auto_dtype == "fp16"
    assert resolve_dtype(cfg, on_gpu=False) == settings_for("cpu").auto_dtype == "fp32"


def test_deepspeed_uses_its_fused_fp16_optimizer_only_for_fused_adam():
    """DeepSpeed's fp16 wrapper is the fused FP16_Optimizer only when the client optimizer is an instance of its
    FusedAdam, else FP16_UnfusedOptimizer: torch's AdamW gets the unfused wrapper, whose step the project's
    MixedPrecisionStep replaces (training/optim/mixed_precision.py)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    src = inspect.getsource(DeepSpeedEngine._configure_fp16_optimizer)
    assert "isinstance(optimizer, fused_opts)" in src and "FusedAdam" in src


def test_build_optimizer_is_torch_fused_adamw():
    from training.config import OptimizerConfig
    from training.optim.adamw import build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt, _ = build_optimizer(model, OptimizerConfig(), 10)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True


def test_local_device_follows_deepspeeds_accelerator(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    assert tdev.local_device() == torch.device("cpu")  # DS_ACCELERATOR=cpu in tests
    acc = get_accelerator()
    monkeypatch.setattr(acc, "device_name", lambda device_index=None: "cuda", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert tdev.local_device() == torch.device("cuda", 3)


Pair = namedtuple("Pair", "tokens labels")


def test_to_device_moves_every_tensor_of_any_nesting():
    batch = {"a": torch.ones(2), "b": [torch.zeros(1), (torch.arange(3), "name", 4)], "c": Pair(torch.ones(1), None)}
    out = tdev.to_device(batch, "meta")
    assert out["a"].device.type == out["b"][0].device.type == out["b"][1][0].device.type == "meta"
    assert isinstance(out["b"][1], tuple) and out["b"][1][1:] == ("name", 4)
    assert isinstance(out["c"], Pair) and out["c"].tokens.device.type == "meta" and out["c"].labels is None
    assert batch["a"].device.type == "cpu"  # the host batch is left as it was


def test_backward_path_placement_on_meta():
    """Forward + backward of the GPT task on a meta model (batch through the mover): every gradient and
    the grad norm's reduction operand live on the model's device, not on the host."""
    from training.models.config import ModelConfig
    from training.models.gpt2 import GPTModel
    from training.parallel.grad_norm import grad_norm

    model = GPTModel(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16), 128, None,
                      seed=1).to("meta")
    gen = torch.Generator().manual_seed(0)
    tokens, labels = tdev.to_device((torch.randint(0, 128, (2, 16), generator=gen),
                                     torch.randint(0, 128, (2, 16), generator=gen)), tdev.module_device(model))
    model(tokens, labels).mean().backward()
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters())
    assert grad_norm(model.parameters(), tp_rank=0).device.type == "meta"
