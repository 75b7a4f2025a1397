"""The Llama-family blocks (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied output layer, no biases):
each against an independent reference, TP=2 equal to TP=1 (logits, loss, every gradient) option by option,
activation checkpointing equal to none, PP=2 / TP=2 x PP=2 training equal to serial, resharding, generation
with a KV cache of grouped heads, the config's one-line refusals, and (with ``transformers``) logits equal to
``LlamaForCausalLM``'s."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import needs_corpus, tiny_overrides
from training.config import ConfigError
from training.models.config import ModelConfig

PADDED_VOCAB = 256  # 200 real ids padded to 256 at TP=1 and TP=2 (128 x 2): identical weights
LLAMA = dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu", num_query_groups=2,
             untie_embeddings_and_output_weights=True, add_bias_linear=False)
# one option at a time on the GPT-2 block, then all of them (the tiny Llama shape)
VARIANTS: dict[str, dict] = {
    "rope": dict(position_embedding="rope"),
    "rope_partial_base5e5": dict(position_embedding="rope", rotary_percent=0.5, rotary_base=500000.0),
    "rmsnorm": dict(normalization="rmsnorm"),
    "swiglu": dict(activation="swiglu"),
    "gqa": dict(num_query_groups=2),
    "untied": dict(untie_embeddings_and_output_weights=True),
    "no_bias": dict(add_bias_linear=False),
    "qkv_bias_only": dict(add_bias_linear=False, add_qkv_bias=True),
    "llama": dict(LLAMA, num_layers=3),
}


def _cfg(dropout=0.0, ckpt=False, **kw):
    base = dict(num_layers=2, hidden_size=96, num_attention_heads=6, seq_length=16, vocab_size=200,
                hidden_dropout=dropout, attention_dropout=dropout, activation_checkpointing=ckpt)
    base.update(kw)
    return ModelConfig(**base)


def _batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 200, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _run(model, tokens, labels):
    logits = model(tokens).detach()
    loss = model(tokens, labels).mean()
    loss.backward()
    return logits, loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------------------
def _rope_complex(x: torch.Tensor, positions: torch.Tensor, rot: int, base: float) -> torch.Tensor:
    """Textbook RoPE in float64 complex numbers: dims (i, i + rot/2) form z_i = x_i + j x_{i+rot/2}, multiplied
    by exp(j m base^(-2i/rot)) at position m; dims >= rot unchanged. x [b, n, s, hn], positions [s]."""
    x = x.double()
    half = rot // 2
    z = torch.complex(x[..., :half], x[..., half:rot])
    theta = base ** (-2.0 * torch.arange(half, dtype=torch.float64) / rot)
    angle = positions.double()[:, None] * theta[None, :]                    # [s, rot/2]
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag, x[..., rot:]], dim=-1)


@pytest.mark.parametrize("rot,base", [(16, 10000.0), (8, 10000.0), (16, 500000.0)])
def test_rope_equals_complex_rotation(rot, base):
    from training.models.blocks import apply_rotary, rotary_cos_sin

    x = torch.randn(2, 3, 40, 16, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40)
    cos, sin = rotary_cos_sin(pos, rot, base, torch.float32)
    got = apply_rotary(x, cos, sin)
    torch.testing.assert_close(got.double(), _rope_complex(x, pos, rot, base), rtol=0, atol=2e-5)
    assert torch.equal(got[..., rot:], x[..., rot:])
    # a rotation: norms of every pair kept; relative: q_m . k_n depends on m - n only
    q, k = torch.randn(2, 16, generator=torch.Generator().manual_seed(1)).unbind(0)
    def dot(m, n):
        cm, sm = rotary_cos_sin(torch.tensor([m]), rot, base, torch.float64)
        cn, sn = rotary_cos_sin(torch.tensor([n]), rot, base, torch.float64)
        return float((apply_rotary(q.double().view(1, 1, 1, 16), cm, sm)
                      * apply_rotary(k.double().view(1, 1, 1, 16), cn, sn)).sum())
    assert dot(7, 3) == pytest.approx(dot(104, 100), rel=1e-6)  # angles in fp32, as transformers
    # per-sequence positions [b, s] (generation with left padding) = the same rotation row by row
    rows = torch.stack([pos, pos + 5])
    c2, s2 = rotary_cos_sin(rows, rot, base, torch.float32)
    both = apply_rotary(x, c2.unsqueeze(1), s2.unsqueeze(1))
    assert torch.equal(both[0], got[0])
    torch.testing.assert_close(both[1].double(), _rope_complex(x[1:], pos + 5, rot, base)[0], rtol=0, atol=2e-5)


def test_rmsnorm_equals_the_formula():
    from training.models.blocks import RMSNorm

    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(0)) * 3 + 1
    norm = RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 96))
    ref = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), ref, rtol=1e-6, atol=1e-6)
    half = norm.to(torch.bfloat16)(x.bfloat16())
    assert half.dtype == torch.bfloat16  # computed in fp32, returned in the input's dtype
    torch.testing.assert_close(half.double(), ref, rtol=2e-2, atol=2e-2)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_gqa_equals_mha_with_repeated_kv_heads(groups):
    """A grouped-query attention equals multi-head attention whose key/value heads are the group's, repeated
    for each of its query heads (the MHA built from the split GQA weights, RoPE on)."""
    from training.models.blocks import ParallelSelfAttention
    from training.models.qkv import fuse_qkv, split_qkv

    n, hn = 6, 16
    gqa = ParallelSelfAttention(_cfg(position_embedding="rope", num_query_groups=groups), None, 1, "a.")
    mha = ParallelSelfAttention(_cfg(position_embedding="rope"), None, 1, "a.")
    assert gqa.qkv.weight.shape == ((n + 2 * groups) * hn, 96) and gqa.local_kv_heads == groups
    with torch.no_grad():
        q, k, v = split_qkv(gqa.qkv.weight, n, groups)
        rep = lambda t: t.view(groups, hn, 96).repeat_interleave(n // groups, 0).reshape(n * hn, 96)  # noqa: E731
        mha.qkv.weight.copy_(fuse_qkv(q, rep(k), rep(v), n, n))
        qb, kb, vb = split_qkv(gqa.qkv.bias + torch.randn_like(gqa.qkv.bias), n, groups)
        gqa.qkv.bias.copy_(fuse_qkv(qb, kb, vb, n, groups))
        mha.qkv.bias.copy_(fuse_qkv(qb, kb.view(groups, hn).repeat_interleave(n // groups, 0).flatten(),
                                    vb.view(groups, hn).repeat_interleave(n // groups, 0).flatten(), n, n))
        mha.proj.load_state_dict(gqa.proj.state_dict())
    x = torch.randn(2, 12, 96, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(gqa(x), mha(x), rtol=0, atol=1e-6)
    # the layout: per group [its query heads; k; v] rows, and fuse/split are inverses
    w = torch.arange((n + 2 * groups) * hn, dtype=torch.float32)[:, None]
    assert torch.equal(fuse_qkv(*split_qkv(w, n, groups), n, groups), w)
    per = n // groups
    qg, kg, _ = split_qkv(w, n, groups)
    assert float(kg[0]) == per * hn  # group 0: its query heads, then its key head
    if groups > 1:
        assert float(qg[per * hn]) == (per + 2) * hn  # group 1's first query row follows group 0's k and v


def test_swiglu_mlp_and_width_rule():
    from training.models.blocks import ParallelMLP
    from training.models.config import swiglu_ffn_size

    assert swiglu_ffn_size(4096) == 11008  # Llama 2 7B's width
    assert swiglu_ffn_size(96) == 256 and _cfg(activation="swiglu").ffn_size == 256
    assert _cfg(activation="swiglu", ffn_hidden_size=160).ffn_size == 160 and _cfg().ffn_size == 384
    mlp = ParallelMLP(_cfg(activation="swiglu", ffn_hidden_size=160, add_bias_linear=False), None, 1, "m.")
    assert mlp.fc.weight.shape == (320, 96) and mlp.fc.weight.partition_stride == 2 and mlp.fc.bias is None
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(0))
    gate, up = mlp.fc.weight[:160], mlp.fc.weight[160:]
    ref = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ mlp.proj.weight.T
    torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-6)


def test_defaults_keep_the_gpt2_block():
    """No option set: the GPT-2 parameters, shapes and partition tags of before (learned positions, LayerNorm,
    [Q; K; V] stride 3, biases, tied output)."""
    from training.models.gpt2 import GPTModel

    model = GPTModel(_cfg(), PADDED_VOCAB, None, seed=1)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["embedding.position_embeddings.weight"] == (16, 96)
    assert shapes["layers.0.attn.qkv.weight"] == (288, 96) and model.layers[0].attn.qkv.weight.partition_stride == 3
    assert {"layers.0.ln1.bias", "layers.0.attn.proj.bias", "layers.0.mlp.fc.bias", "final_ln.bias"} <= set(shapes)
    assert not any(n.startswith("output_layer") for n in shapes) and model.output_layer is None
    assert isinstance(model.final_ln, torch.nn.LayerNorm)


def _tp_worker(rank, world, variants):
    from training.models.gpt2 import GPTModel
    from training.parallel import random as tp_random
    from training.parallel.mappings import COLLECTIVE_CALLS
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=world)
    tp_random.configure(ps, num_layers=3)
    out = {}
    tokens, labels = _batch()
    for name, kw in variants.items():
        tp_random.set_seed(1234)
        model = GPTModel(_cfg(**kw), PADDED_VOCAB, ps.tp_group, seed=1234).eval()
        x = torch.randn(2, 16, 96, requires_grad=True)
        COLLECTIVE_CALLS.clear()
        model.layers[0](x).sum().backward()
        calls = dict(COLLECTIVE_CALLS)
        model.zero_grad()
        logits, loss, grads = _run(model, tokens, labels)
        tags = {n: (getattr(p, "partition_dim", None), getattr(p, "partition_stride", None))
                for n, p in model.named_parameters()}
        out[name] = {"logits": logits, "loss": loss, "grads": grads, "tags": tags, "calls": calls}
    # the Llama shape with dropout: activation checkpointing replays the same masks (loss and gradients)
    runs = []
    for ckpt in (False, True):
        model = GPTModel(_cfg(0.1, ckpt, **VARIANTS["llama"]), PADDED_VOCAB, ps.tp_group, seed=1234).train()
        tp_random.set_seed(99)
        runs.append(_run(model, tokens, labels)[1:])
    out["ckpt"] = runs
    return out


def _merge(name, shards, tags):
    from training.parallel.sharding import merge_tagged

    dim, stride = tags[name]
    return merge_tagged(shards, None if dim is None else (dim, stride))


def test_each_option_tp2_equals_tp1_and_checkpointing_changes_nothing():
    from training.models.gpt2 import GPTModel

    res = run_distributed(_tp_worker, 2, VARIANTS)
    tokens, labels = _batch()
    for name, kw in VARIANTS.items():
        ref = GPTModel(_cfg(**kw), PADDED_VOCAB, None, seed=1234).eval()
        logits, loss, grads = _run(ref, tokens, labels)
        r0, r1 = res[0][name], res[1][name]
        tags = r0["tags"]
        assert set(tags) == set(grads), name
        torch.testing.assert_close(r0["loss"], loss, rtol=0, atol=2e-6, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(torch.cat([r0["logits"], r1["logits"]], -1), logits, rtol=0, atol=2e-6,
                                   msg=lambda m: f"{name} logits: {m}")
        for pname, g in grads.items():
            merged = _merge(pname, [r0["grads"][pname], r1["grads"][pname]], tags)
            torch.testing.assert_close(merged, g, rtol=0, atol=1e-6, msg=lambda m: f"{name} {pname}: {m}")
            if tags[pname][0] is None:  # replicated parameters: the same gradient on both ranks, bit for bit
                assert torch.equal(r0["grads"][pname], r1["grads"][pname]), (name, pname)
        # still two all-reduces per layer forward and two backward
        assert r0["calls"] == {"all_reduce": 4}, (name, r0["calls"])
    llama = res[0]["llama"]["tags"]
    assert llama["layers.0.attn.qkv.weight"] == (0, 1) and llama["layers.0.mlp.fc.weight"] == (0, 2)
    assert llama["output_layer.weight"] == (0, 1) and llama["layers.0.ln1.weight"] == (None, None)
    assert "embedding.position_embeddings.weight" not in llama and "layers.0.mlp.fc.bias" not in llama
    for rank in range(2):
        (l0, g0), (l1, g1) = res[rank]["ckpt"]
        assert torch.equal(l0, l1)
        for pname in g0:
            torch.testing.assert_close(g1[pname], g0[pname], rtol=0, atol=1e-7, msg=lambda m: f"{pname}: {m}")


# --------------------------------------------------------------------------------------------------
# Config: one-line refusals
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,message", [
    (["model.num_query_groups=4"], "model.num_query_groups=4 does not divide model.num_attention_heads=6"),
    (["model.num_query_groups=3"], "parallel.tensor=2 does not divide model.num_query_groups=3"),
    (["model.num_query_groups=0"], "model.num_query_groups must be >= 1"),
    (["model.rotary_percent=0.2"], "RoPE needs a positive even number"),
    (["model.rotary_percent=1.5"], "model.rotary_percent must be in (0, 1]"),
    (["model.position_embedding=learned"], "set model.position_embedding=rope"),
    (["model.activation=geglu"], "model.activation: 'geglu' is not one of"),
    (["model.normalization=layer_norm"], "model.normalization: 'layer_norm' is not one of"),
    (["model.sliding_window=0"], "model.sliding_window must be >= 1"),
    (["model.sliding_window=8", "parallel.pipeline=2"], "the window's mask does not cross pipeline stages yet"),
])
def test_llama_config_refusals_are_one_line(overrides, message):
    from pathlib import Path

    from training.config import load_config

    root = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError) as e:
        # rotary_base is set in llama_tiny.yaml, so learned positions with it are refused
        load_config(root / "configs" / "llama_tiny.yaml", ["model.rotary_base=500000", *overrides])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key,value", [("position_embedding", "rope"), ("normalization", "rmsnorm"),
                                       ("activation", "swiglu"), ("num_query_groups", 2),
                                       ("untie_embeddings_and_output_weights", True), ("add_bias_linear", False),
                                       ("sliding_window", 8)])
def test_bert_refuses_the_gpt_only_options(key, value):
    from pathlib import Path

    from training.config import load_config

    root = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError, match=rf"model.{key}={value}: the Llama-family options are for GPT"):
        load_config(root / "configs" / "bert_tiny.yaml", [f"model.{key}={value}"])


def test_llama_configs_load_and_plan():
    """The three configs load; the planner counts the model's own parameters (TP=1 and the per-rank shard) and
    the published Llama sizes."""
    from pathlib import Path

    from training.config import load_config
    from training.models.gpt2 import GPTModel
    from training.plan.accounting import ModelShape, stage_params, total_params
    from training.plan.cli import load_plan_config

    root = Path(__file__).resolve().parents[2]
    tiny = load_config(root / "configs" / "llama_tiny.yaml", ["model.vocab_size=1000"]).model
    assert (tiny.query_groups, tiny.ffn_size, tiny.rotary_dim) == (2, 256, 16)
    shape = ModelShape.from_config(tiny, 1)
    model = GPTModel(tiny, shape.vocab, None, seed=1)
    assert total_params(shape) == model.num_parameters() == sum(p.numel() for p in model.parameters())
    sizes = {"llama_1b": 1_235_814_400, "llama_8b": 8_030_261_248}  # Llama 3.2 1B, Llama 3 8B (vocabulary 128,256)
    for name, n in sizes.items():
        cfg = load_plan_config(str(root / "configs" / f"{name}.yaml"), None, [])
        assert total_params(ModelShape.from_config(cfg.model, 2)) == n
    # PP=2: the untied output layer on the last stage, no embedding copy there
    s = ModelShape.from_config(tiny, 1)
    st = stage_params(s, 1, 3)
    assert st[2] - st[1] == s.hidden + s.vocab * s.hidden and sum(st) == total_params(s)


def _shard_numel(rank, world):
    from pathlib import Path

    import torch.distributed as dist

    from training.config import load_config
    from training.models.gpt2 import GPTModel

    root = Path(__file__).resolve().parents[2]
    m = load_config(root / "configs" / "llama_tiny.yaml", ["model.vocab_size=1000"]).model
    return sum(p.numel() for p in GPTModel(m, 1024, dist.group.WORLD, seed=1).parameters())


def test_planner_tp2_shard_equals_the_model_shard():
    from pathlib import Path

    from training.config import load_config
    from training.plan.accounting import ModelShape, stage_params

    root = Path(__file__).resolve().parents[2]
    m = load_config(root / "configs" / "llama_tiny.yaml", ["model.vocab_size=1000"]).model
    counts = run_distributed(_shard_numel, 2)
    assert counts == [stage_params(ModelShape.from_config(m, 2), 2, 1)[0]] * 2


def test_llama_flops_match_the_flop_counter():
    """MFU FLOPs (training.plan.accounting) of the tiny Llama against torch's FlopCounterMode (matmuls only, SDPA's
    math backend so its two matmuls are seen), and against an independent count of the matrices."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from training.config import Config
    from training.models.gpt2 import GPTModel
    from training.plan.accounting import flops_per_iteration, model_flops_per_iteration

    cfg = Config(model=_cfg(**VARIANTS["llama"]))
    cfg.train.global_batch_size = 2
    model = GPTModel(cfg.model, PADDED_VOCAB, None, seed=1).eval()
    tokens, labels = _batch()
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd:
            loss = model(tokens, labels).mean()
        with FlopCounterMode(display=False) as bwd:
            loss.backward()
    counted = fwd.get_total_flops() + bwd.get_total_flops()
    b, s, l, h, f, V, kv = 2, 16, 3, 96, 256, PADDED_VOCAB, 2 * 16
    # per token and layer: q 2h.h, k and v 2h.kv each, o 2h.h, gate/up/down 3 x 2h.f; scores and P.V 2 x 2s.h
    by_hand = 3 * b * s * (l * (2 * h * h + 4 * h * kv + 2 * h * h + 6 * h * f + 4 * s * h) + 2 * h * V)
    assert counted == by_hand == flops_per_iteration(cfg, PADDED_VOCAB)
    assert by_hand == model_flops_per_iteration(b, s, l, h, V, f, kv, gated=True)
    assert math.isclose(model_flops_per_iteration(b, s, l, h, V, 4 * h), 72 * b * s * l * h * h * (1 + s / (6 * h))
                        + 6 * b * s * h * V)  # the GPT-2 count unchanged


# --------------------------------------------------------------------------------------------------
# Generation: KV cache of grouped, rotated keys
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 5])
def test_kv_cached_generation_equals_the_full_forward(window):
    """Prefill then one token at a time over the GQA cache equals the full forward, with and without Mistral's
    sliding window (5 of 30 positions: the window's mask narrows the cached steps as it does the full pass)."""
    from evaluation.generate import GenerationOptions, KVCache, forward_cached, generate_ids
    from training.models.gpt2 import GPTModel

    model = GPTModel(_cfg(**dict(VARIANTS["llama"], seq_length=32, sliding_window=window)), PADDED_VOCAB, None,
                     seed=3).eval()
    seq = torch.randint(0, 200, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(seq)
        cache = KVCache(model, 2, 30, "cpu", torch.float32)
        assert cache.k[0].shape == (2, 2, 30, 16)  # the 2 key/value heads, not 6
        valid = torch.ones(2, 30, dtype=torch.bool)
        steps = [forward_cached(model, seq[:, :10], torch.arange(10).expand(2, 10), valid, cache)]
        for t in range(10, 30):
            steps.append(forward_cached(model, seq[:, t:t + 1], torch.full((2, 1), t), valid, cache))
    torch.testing.assert_close(steps[0], full[:, 9], rtol=0, atol=1e-5)
    for i, t in enumerate(range(10, 30)):
        torch.testing.assert_close(steps[i + 1], full[:, t], rtol=0, atol=1e-5)
    # greedy with left padding: each prompt continues as it does alone
    prompts = [[5, 17, 33, 2, 9, 100, 7], [42, 8]]
    batch = generate_ids(model, prompts, GenerationOptions(max_new_tokens=6, greedy=True), None, 200)
    for p, (new, _) in zip(prompts, batch):
        ids = list(p)
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(model(torch.tensor([ids]))[0, -1, :200].argmax()))
        assert new == ids[len(p):]


# --------------------------------------------------------------------------------------------------
# transformers' LlamaForCausalLM
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("theta,kv_heads,tied,bias", [(10000.0, 2, False, False), (500000.0, 2, False, False),
                                                      (500000.0, 1, True, False), (10000.0, 6, False, True)])
def test_logits_equal_transformers_llama(theta, kv_heads, tied, bias):
    transformers = pytest.importorskip("transformers")
    from training.models.gpt2 import GPTModel
    from training.parallel.sharding import resize_vocab_rows
    from training.tools.hf_llama import from_hf, hf_config, model_config_from_hf, to_hf

    hc = transformers.LlamaConfig(vocab_size=200, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                                  num_attention_heads=6, num_key_value_heads=kv_heads, max_position_embeddings=64,
                                  rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": theta},
                                  tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hc).eval()
    with torch.no_grad():
        for p in hf.parameters():  # random everywhere (RMSNorm weights are ones and biases zeros at init)
            p.normal_(0.0, 0.1)
    cfg = model_config_from_hf(hf.config, seq_length=48)
    assert (cfg.rotary_base, cfg.query_groups, cfg.untie_embeddings_and_output_weights) == (theta, kv_heads, not tied)
    weights = {k: (resize_vocab_rows(v, PADDED_VOCAB) if k.endswith(("word_embeddings.weight", "output_layer.weight"))
                   else v) for k, v in from_hf(hf.state_dict(), cfg).items()}
    ours = GPTModel(cfg, PADDED_VOCAB, None, seed=0).eval()
    ours.load_state_dict(weights, strict=True)
    tokens = torch.randint(0, 200, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens)[..., :200], hf(tokens).logits, rtol=0, atol=1e-5)
    back = to_hf({k: v for k, v in ours.state_dict().items()}, cfg, 200)
    theirs = hf.state_dict()
    assert set(back) == set(theirs) and all(torch.equal(back[k], theirs[k]) for k in theirs)
    again = hf_config(cfg)
    assert (again.num_key_value_heads, again.rope_parameters["rope_theta"], again.tie_word_embeddings) == (
        kv_heads, theta, tied)


def test_unsupported_llama_configs_are_refused():
    transformers = pytest.importorskip("transformers")
    from training.tools.hf_llama import LlamaMappingError, model_config_from_hf

    # llama3 scaling maps (tests/unit/test_rope_scaling.py); linear position interpolation does not
    scaled = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=96,
                                      rope_parameters={"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0})
    with pytest.raises(LlamaMappingError, match="rope_type='linear'"):
        model_config_from_hf(scaled)


# --------------------------------------------------------------------------------------------------
# Training under DeepSpeed: TP, PP, recompute, checkpoints, resharding
# --------------------------------------------------------------------------------------------------
def _train(rank, world, overrides, stages):
    import json
    from pathlib import Path

    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    root = Path(__file__).resolve().parents[2]
    for extra in stages:
        cfg = load_config(root / "configs" / "llama_tiny.yaml", overrides + extra)
        Trainer(resolve_run(cfg)).train()
    rows = [json.loads(line) for line in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "event" not in r]


def _logits(rank, world, dirs):
    from training.checkpoint_reader import load_model_for_eval

    tokens = (torch.arange(32).view(1, 32) * 7) % 1000
    return [load_model_for_eval(d)[0](tokens)[..., :1000].detach() for d in dirs]


def _train_then_logits(rank, world, overrides, dirs):
    """One-rank worker: the run with ``overrides`` (its losses), then the logits of ``dirs`` (one launch for both)."""
    return _train(rank, world, overrides, [[]]), _logits(rank, world, dirs)


@needs_corpus
def test_llama_tiny_trains_at_tp_and_pp_and_reshards(spm_model, tmp_path):
    """configs/llama_tiny.yaml under the Trainer: PP=2 and TP=2 x PP=2 with activation checkpointing give the
    serial losses (and learn); the TP=2 x PP=2 checkpoint (untied output layer on the last stage) reshards to
    TP=1 and back to TP=2 with the same logits as the serial run's."""
    from training.tools.reshard import reshard

    common = {"train.iters": 4, "optimizer.lr": 3e-3, "optimizer.decay_style": "constant", "optimizer.warmup_iters": 0}
    run = lambda world, name, **kw: run_distributed(_train, world, tiny_overrides(spm_model, tmp_path / name, **kw,  # noqa: E731
                                                                              **common), [[]])[0]
    lp = torch.tensor(run(2, "pp2", **{"parallel.tensor": 1, "parallel.pipeline": 2}))
    ltp = torch.tensor(run(4, "tp2pp2", **{"parallel.tensor": 2, "parallel.pipeline": 2,
                                           "model.activation_checkpointing": "true"}))
    reshard(tmp_path / "tp2pp2", tp=1, pp=1, out=tmp_path / "to_tp1")
    reshard(tmp_path / "to_tp1", tp=2, pp=1, out=tmp_path / "to_tp2")
    # the serial run, then every checkpoint's logits, in one launch
    dirs = [str(tmp_path / d) for d in ("serial", "pp2", "tp2pp2", "to_tp1", "to_tp2")]
    l1, (serial, pp2, tp2pp2, to_tp1, to_tp2) = run_distributed(
        _train_then_logits, 1, tiny_overrides(spm_model, tmp_path / "serial", **{"parallel.tensor": 1}, **common), dirs,
        timeout=600)[0]
    l1 = torch.tensor(l1)
    assert len(l1) == 4 and l1[-1] < l1[0] - 0.2, l1  # learning (ln 1000 = 6.9 at the start)
    torch.testing.assert_close(lp, l1, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ltp, l1, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(pp2, serial, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tp2pp2, serial, rtol=1e-3, atol=1e-3)
    assert torch.equal(to_tp1, tp2pp2) and torch.equal(to_tp2, tp2pp2)


@pytest.mark.parametrize("kv_heads,theta,tied,tp,pp", [(2, 10000.0, False, 2, 2), (1, 500000.0, True, 1, 1)])
def test_import_and_export_llama_folders(tmp_path, kv_heads, theta, tied, tp, pp):
    """import_hf of a LlamaForCausalLM folder (written at TP x PP, merged back by the checkpoint reader) gives
    transformers' logits; export_hf writes the same weights back (export(import(x)) == x) and a folder
    transformers loads with the same logits; greedy generation equals transformers' token for token."""
    transformers = pytest.importorskip("transformers")
    from tests.helpers.hf_models import GPT2_TOKENIZER, save_random_llama

    if not GPT2_TOKENIZER.is_dir():
        pytest.skip("../shared/data/tokenizers/gpt2 absent")
    from safetensors.torch import load_file

    from evaluation.generate import GenerationOptions, generate
    from training.checkpoint_reader import load_model_for_eval
    from training.tools.export_hf import export
    from training.tools.import_hf import import_hf

    src = save_random_llama(tmp_path / "hf", kv_heads=kv_heads, rope_theta=theta, tied=tied)
    run = import_hf(str(src), tmp_path / "run", tp=tp, pp=pp, seq_length=64)
    model, cfg, tok = load_model_for_eval(run)
    assert (cfg.model.query_groups, cfg.model.rotary_base, tok.spec()["kind"]) == (kv_heads, theta, "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(src)).eval()
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog, twice.")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :50257], hf(ids).logits, rtol=0, atol=1e-5)
    export(run, tmp_path / "back")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    again = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)
    prompt = "Once upon a time"
    ours = generate(model, tok, [prompt], GenerationOptions(max_new_tokens=8, greedy=True, stop_at_eod=False))[0]
    p = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        ref = hf.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          pad_token_id=tok.eod)[0, p.size(1):].tolist()
    assert ours.tokens == ref


def test_qwen2_weights_map_both_ways_with_the_qkv_bias(tmp_path):
    """Qwen2ForCausalLM (a bias on q/k/v only, Megatron-Core's add_qkv_bias): its config and weights mapped into our
    model at TP=1 give transformers' logits, and mapped back build a Qwen2ForCausalLM with the same tensors. (The
    folder import is the same code; its tokenizer check needs a real Qwen2 tokenizer.json, which transformers 5's
    Qwen2Tokenizer re-reads with Qwen's own pre-tokenizer, so it is not exercised here.)"""
    transformers = pytest.importorskip("transformers")
    from tests.helpers.hf_models import GPT2_TOKENIZER, save_random_llama

    if not GPT2_TOKENIZER.is_dir():
        pytest.skip("../shared/data/tokenizers/gpt2 absent")
    from training.models.config import padded_vocab_size
    from training.models.gpt2 import GPTModel
    from training.tools.hf_llama import build_hf_llama, from_hf, model_config_from_hf

    src = save_random_llama(tmp_path / "hf", kv_heads=2, family="qwen2")
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(src)).eval()
    cfg = model_config_from_hf(hf.config, 64)
    assert cfg.add_qkv_bias and not cfg.add_bias_linear
    padded = padded_vocab_size(50257, cfg.make_vocab_size_divisible_by, 1)
    model = GPTModel(cfg, padded).eval()
    weights = from_hf(hf.state_dict(), cfg)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        weights[name] = torch.cat([weights[name], torch.zeros(padded - 50257, cfg.hidden_size)])
    model.load_state_dict(weights, strict=True)
    ids = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :50257], hf(ids).logits, rtol=0, atol=1e-5)
    back = build_hf_llama(model.state_dict(), cfg, 50257)
    assert type(back).__name__ == "Qwen2ForCausalLM"
    theirs = hf.state_dict()
    assert set(back.state_dict()) == set(theirs)
    assert all(torch.equal(v, theirs[k]) for k, v in back.state_dict().items())


@pytest.mark.parametrize("family,tp", [("mistral", 1)])
def test_mistral_and_qwen2_folders_import_and_export(tmp_path, family, tp):
    """MistralForCausalLM (no sliding window) and Qwen2ForCausalLM (bias on q/k/v only) share Llama's map: their
    logits after import (Qwen2 at TP=2: the q/k/v bias split with the heads) equal transformers', and the export
    holds the same tensors (Mistral as LlamaForCausalLM, the same block and names; Qwen2 as Qwen2ForCausalLM).
    A Mistral sliding window shorter than the sequence (model.sliding_window) gives transformers' logits and greedy
    generation and exports back as MistralForCausalLM."""
    transformers = pytest.importorskip("transformers")
    from tests.helpers.hf_models import GPT2_TOKENIZER, save_random_llama

    if not GPT2_TOKENIZER.is_dir():
        pytest.skip("../shared/data/tokenizers/gpt2 absent")
    from safetensors.torch import load_file

    from training.checkpoint_reader import load_model_for_eval
    from training.tools.export_hf import export
    from training.tools.hf_llama import LlamaMappingError
    from training.tools.import_hf import import_hf

    extra = {"sliding_window": None} if family == "mistral" else {}
    src = save_random_llama(tmp_path / "hf", kv_heads=2, family=family, **extra)
    run = import_hf(str(src), tmp_path / "run", tp=tp, seq_length=64)
    model, cfg, tok = load_model_for_eval(run)
    assert cfg.model.add_qkv_bias == (family == "qwen2") and not cfg.model.add_bias_linear
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src)).eval()
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog, twice.")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :50257], hf(ids).logits, rtol=0, atol=1e-5)
    export(run, tmp_path / "back")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert type(again).__name__ == ("Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM")
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=1e-6)
    if family == "mistral":  # a sliding window of 16 over 48 tokens: logits, greedy generation and the way back
        windowed = save_random_llama(tmp_path / "windowed", family="mistral", sliding_window=16)
        run_w = import_hf(str(windowed), tmp_path / "w", seq_length=64)
        model_w, cfg_w, _ = load_model_for_eval(run_w)
        assert cfg_w.model.sliding_window == 16
        hf_w = transformers.AutoModelForCausalLM.from_pretrained(str(windowed)).eval()
        long_ids = torch.randint(0, 50257, (2, 48), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            theirs = hf_w(long_ids).logits
            torch.testing.assert_close(model_w(long_ids)[..., :50257], theirs, rtol=0, atol=1e-5)
            full = transformers.AutoModelForCausalLM.from_pretrained(str(windowed), sliding_window=None).eval()
            assert (full(long_ids).logits - theirs).abs().max() > 1e-2  # the window changes the logits
            prompt = long_ids[:1, :20]
            want = hf_w.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=50256)[0, 20:].tolist()
        from evaluation.generate import GenerationOptions, generate_ids

        got = generate_ids(model_w, [prompt[0].tolist()], GenerationOptions(max_new_tokens=12, greedy=True), None,
                           50257)[0][0]
        assert got == want
        export(run_w, tmp_path / "back_w")
        again_w = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back_w")).eval()
        assert type(again_w).__name__ == "MistralForCausalLM" and again_w.config.sliding_window == 16
        with torch.no_grad():
            torch.testing.assert_close(again_w(long_ids).logits, theirs, rtol=0, atol=1e-6)
        bad = save_random_llama(tmp_path / "bad", family="mistral", sliding_window=-3)
        with pytest.raises(LlamaMappingError, match="sliding_window=-3 .not a positive integer"):
            import_hf(str(bad), tmp_path / "refused", seq_length=64)
        assert not (tmp_path / "refused").exists()
