"""The attention cores of ``training/models/core_attention.py``: chosen once per layer from the config (the
attention module's ``core_attention`` attribute), no forward reading the config, each core against a float64
serial reference (causal, a padding mask, a KV-cache step's mask; grouped-query heads), and selective
recomputation (``Recomputed``) giving the core's own numbers bit for bit. The cores' dropout streams under
tensor parallelism are checked in tests/parallel/test_selective_recompute.py and tests/parallel/test_compile.py."""
from __future__ import annotations

import math

import pytest
import torch

from training.config import ModelConfig
from training.models.blocks import ParallelSelfAttention, TransformerLayer
from training.models.core_attention import (
    AttentionCore,
    CPUDropoutCore,
    MegatronCore,
    Recomputed,
    SDPACore,
    build_core,
)
from training.parallel import random as tp_random

SDPA, CPU, MEGATRON = SDPACore, CPUDropoutCore, MegatronCore


@pytest.fixture(autouse=True)
def _no_model_parallel_stream():
    """These tests seed torch's default generator and compare runs: once a tensor-parallel dropout stream is seeded
    in this process (by an earlier in-process test), the cores draw from it instead and two runs differ. Each test
    runs with no stream, as in a fresh process; the stream comes back afterwards."""
    tracker = tp_random.get_tracker()
    saved = tracker.get_states()
    tracker.reset()
    yield
    tracker.set_states(saved)


@pytest.mark.parametrize("extra,causal,expected", [
    ({}, True, CPU),                                                      # GPT with attention dropout
    ({}, False, SDPA),                                                    # BERT
    ({"attention_dropout": 0.0}, True, SDPA),
    ({"attention_softmax_in_fp32": True}, True, MEGATRON),
    ({"apply_query_key_layer_scaling": True}, False, MEGATRON),
    ({"apply_query_key_layer_scaling": True, "attention_dropout": 0.0}, True, MEGATRON),
])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_core_is_chosen_once_from_the_config(extra, causal, expected, recompute):
    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, recompute=recompute, **extra)
    core = ParallelSelfAttention(cfg, None, 1, "layers.2.attn.", causal=causal, layer_number=3).core_attention
    if recompute == "selective":                                          # selective wraps the chosen core
        assert type(core) is Recomputed
        core = core.core
    assert type(core) is expected
    assert (core.dropout_p, core.causal, core.layer_number) == (cfg.attention_dropout, causal, 3)
    if expected is MEGATRON:
        assert (core.query_key_layer_scaling, core.softmax_in_fp32) == (cfg.apply_query_key_layer_scaling,
                                                                        cfg.attention_softmax_in_fp32)
    # the cores hold no parameters: state dicts and checkpoints are those of before
    assert not list(core.parameters()) and not list(core.buffers())


def test_forward_reads_no_config():
    """The layer keeps no ModelConfig; changing the config after the build changes nothing it computes."""
    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, num_query_groups=2, hidden_dropout=0.0,
                      attention_dropout=0.0)
    layer = TransformerLayer(cfg, None, 1, 0).train()
    assert not [(name, k) for name, m in layer.named_modules() for k, v in vars(m).items()
                if isinstance(v, ModelConfig)]
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    before = layer(x)
    cfg.attention_dropout, cfg.attention_softmax_in_fp32, cfg.recompute = 0.5, True, "selective"
    assert torch.equal(layer(x), before)
    assert type(layer.attn.core_attention) is SDPA


def _reference(q, k, v, keep):
    """softmax(Q K^T / sqrt(hn), masked where ``keep`` is False) V in float64, key/value heads repeated."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1) @ v


def _cores(causal: bool) -> dict[str, AttentionCore]:
    return {"sdpa": SDPACore(0.1, causal, 3), "cpu": CPUDropoutCore(0.1, causal, 3),
            "fp32 softmax": MegatronCore(0.1, causal, 3, False, True),
            "layer scaling": MegatronCore(0.1, causal, 3, True, True)}


@pytest.mark.parametrize("case", ["causal", "padding", "cache step"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_core_matches_the_serial_reference(case, dtype):
    """Eval mode (no dropout): 4 query heads over 2 key/value groups. ``padding``: BERT's bidirectional layer
    with a [b, 1, 1, sk] key mask; ``cache step``: 3 new queries after 5 cached keys under the KV cache's mask."""
    g = torch.Generator().manual_seed(1)
    b, n, kv, s, hn = 2, 4, 2, 8, 16
    sk = s
    if case == "cache step":
        s = 3
    q = torch.randn(b, n, s, hn, generator=g)
    k, v = torch.randn(b, kv, sk, hn, generator=g), torch.randn(b, kv, sk, hn, generator=g)
    causal = case != "padding"
    mask = keep = None
    if case == "causal":
        keep = torch.ones(s, sk, dtype=torch.bool).tril()
    elif case == "padding":
        mask = torch.ones(b, 1, 1, sk, dtype=torch.bool)
        mask[1, ..., 5:] = False
        keep = mask
    else:
        mask = keep = torch.ones(s, sk, dtype=torch.bool).tril(sk - s)[None, None]
    ref = _reference(q.to(dtype), k.to(dtype), v.to(dtype), keep)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, core in _cores(causal).items():
        y = core.eval()(q.to(dtype), k.to(dtype), v.to(dtype), mask)
        assert y.dtype == dtype and y.shape == (b, n, s, hn), name
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=tol, msg=name)


@pytest.mark.parametrize("name", ["sdpa", "cpu", "fp32 softmax"])
def test_recomputed_core_gives_the_core_numbers_bit_for_bit(name):
    """Training with dropout on CPU (every core keeps its scores there): the same output and q, k, v gradients
    as the core alone, the dropout mask replayed in backward, and the generator left where the core leaves it."""
    def run(module, seed=5):
        g = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(2, 4, 8, 16, generator=g).requires_grad_() for _ in range(3))
        torch.manual_seed(seed)
        y = module.train()(q, k, v)
        y.square().sum().backward()
        return [y.detach(), q.grad, k.grad, v.grad, torch.get_rng_state()]

    core = _cores(True)[name]
    plain, recomputed = run(core), run(Recomputed(core))
    for a, b in zip(plain, recomputed, strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(run(core, seed=6)[0], plain[0])                       # dropout is on: not vacuous


def test_build_core_for_a_layer():
    cfg = ModelConfig(recompute="selective", attention_softmax_in_fp32=True)
    core = build_core(cfg, 7, causal=True)
    assert type(core) is Recomputed and type(core.core) is MegatronCore and core.core.layer_number == 7
    assert "softmax_in_fp32=True" in repr(core)


# --- the GPT model's name: GPTModel, model.arch gpt (gpt2 its old name) ------------------------------------------
@pytest.mark.parametrize("arch", ["gpt", "gpt2"])
def test_gpt_and_gpt2_are_one_family(arch):
    from training.config import ConfigError, config_from_dict
    from training.models.gpt2 import GPT2Model, GPTModel

    assert GPT2Model is GPTModel
    llama = {"arch": arch, "position_embedding": "rope", "normalization": "rmsnorm", "num_query_groups": 2}
    cfg = config_from_dict({"model": llama})
    assert cfg.model.arch == arch and cfg.to_dict()["model"]["arch"] == arch     # saved as written
    with pytest.raises(ConfigError, match=r"the Llama-family options are for GPT \(model.arch: gpt\)"):
        config_from_dict({"model": {**llama, "arch": "bert"}})
    with pytest.raises(ConfigError, match="model.arch: 'gpt3' is not one of 'gpt', 'gpt2', 'bert'"):
        config_from_dict({"model": {"arch": "gpt3"}})
    assert ModelConfig().arch == "gpt"
