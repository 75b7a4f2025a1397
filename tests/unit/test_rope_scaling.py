"""RoPE tables and Llama 3's frequency scaling (issue 28; issue 27's note on per-layer cos/sin).

* ``model.rope_scaling`` (``rope_type: llama3``): the frequencies against a piecewise re-statement of the rule in
  float64, and a random ``transformers`` ``LlamaForCausalLM`` with llama3 scaling gives our logits (fp32, 1e-5),
  imported and exported through ``training.tools.hf_llama`` (its ``rope_parameters`` both ways);
* the cos/sin tables are computed once per sequence length, device and dtype, not in every layer: a forward of
  the tiny Llama dispatches no ``cos``/``sin``/``pow`` once the table exists, and a table made under
  ``torch.inference_mode`` still trains.
"""
from __future__ import annotations

import math

import pytest
import torch

from training.config import ConfigError, config_from_dict
from training.models.config import ModelConfig, RopeScalingConfig

PADDED_VOCAB = 256
# a small original context so that, at head size 16, every branch of the rule is taken
SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=48)


def _reference_frequencies(dim: int, base: float, factor: float, low: float, high: float, original: int) -> list[float]:
    """Llama 3.1's rule, one frequency at a time in float64: wavelength above original/low -> divided by factor;
    below original/high -> kept; else interpolated by how many turns it makes over the original context."""
    out = []
    for i in range(0, dim, 2):
        theta = base ** (-i / dim)
        wavelength = 2 * math.pi / theta
        if wavelength > original / low:
            out.append(theta / factor)
        elif wavelength < original / high:
            out.append(theta)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * theta / factor + smooth * theta)
    return out


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_llama3_frequencies_follow_the_rule(base):
    from training.models.rotary import inverse_frequencies

    sc = tuple(SCALING.values())
    got = inverse_frequencies(16, base, sc).double()
    ref = torch.tensor(_reference_frequencies(16, base, *sc), dtype=torch.float64)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    plain = inverse_frequencies(16, base).double()
    kept, divided = got == plain, torch.isclose(got, plain / 8.0, rtol=1e-6)
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # all three branches taken


@pytest.mark.parametrize("kv_heads,theta", [(2, 500000.0), (6, 10000.0)])
def test_logits_equal_transformers_llama_with_llama3_scaling(kv_heads, theta):
    transformers = pytest.importorskip("transformers")
    from training.models.gpt2 import GPTModel
    from training.parallel.sharding import resize_vocab_rows
    from training.tools.hf_llama import from_hf, hf_config, model_config_from_hf

    rope = {"rope_type": "llama3", "rope_theta": theta, **SCALING}
    hc = transformers.LlamaConfig(vocab_size=200, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                  num_attention_heads=6, num_key_value_heads=kv_heads, max_position_embeddings=64,
                                  rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hc).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
    cfg = model_config_from_hf(hf.config, seq_length=48)
    assert cfg.rope_scaling == RopeScalingConfig(**SCALING) and cfg.rotary_base == theta
    weights = {k: (resize_vocab_rows(v, PADDED_VOCAB) if k.endswith(("word_embeddings.weight", "output_layer.weight"))
                   else v) for k, v in from_hf(hf.state_dict(), cfg).items()}
    ours = GPTModel(cfg, PADDED_VOCAB, None, seed=0).eval()
    ours.load_state_dict(weights, strict=True)
    tokens = torch.randint(0, 200, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours(tokens)[..., :200]
        torch.testing.assert_close(got, hf(tokens).logits, rtol=0, atol=1e-5)
        # the scaling matters: without it the logits differ by more than ten times the tolerance
        plain = GPTModel(_without_scaling(cfg), PADDED_VOCAB, None, seed=0).eval()
        plain.load_state_dict(weights, strict=True)
        assert (plain(tokens)[..., :200] - got).abs().max() > 1e-4
    back = hf_config(cfg).rope_parameters
    assert {k: back[k] for k in rope} == rope


def _without_scaling(cfg: ModelConfig) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, rope_scaling=None)


def test_rope_scaling_config_keys_and_refusals():
    cfg = config_from_dict({"model": {"position_embedding": "rope", "rope_scaling": {"rope_type": "llama3",
                                                                                       "factor": 32}}})
    assert cfg.model.llama3_rope_scaling == (32.0, 1.0, 4.0, 8192)
    assert config_from_dict(cfg.to_dict()).model.rope_scaling == cfg.model.rope_scaling  # saved config round trip
    with pytest.raises(ConfigError, match="model.rope_scaling.rope_type: 'yarn' is not one of 'llama3'"):
        config_from_dict({"model": {"position_embedding": "rope", "rope_scaling": {"rope_type": "yarn"}}})
    with pytest.raises(ConfigError, match="need factor >= 1, 0 < low_freq_factor < high_freq_factor"):
        config_from_dict({"model": {"position_embedding": "rope", "rope_scaling": {"low_freq_factor": 4.0}}})
    with pytest.raises(ConfigError, match="set model.position_embedding=rope"):
        config_from_dict({"model": {"rope_scaling": {"factor": 8.0}}})
    with pytest.raises(ConfigError, match="Llama-family options are for GPT"):
        config_from_dict({"model": {"arch": "bert", "rope_scaling": {"factor": 8.0}}})


def test_cos_sin_tables_are_computed_once_not_per_layer():
    """Issue 27's note: the tiny Llama's forward dispatched 13 ops per layer for its RoPE tables (arange, pow,
    reciprocal, mul, cat, cos, sin, casts); now the table is made once per (length, device, dtype)."""
    from benchmarks.host_work import HostWork
    from training.config import load_config
    from training.models.gpt2 import GPTModel
    from training.models.rotary import rotary_table

    def forward_ops(layers: int) -> HostWork:
        cfg = load_config("configs/llama_tiny.yaml", ["parallel.tensor=1", "data.corpus=x",
                                                      f"model.num_layers={layers}"]).model
        model = GPTModel(cfg, PADDED_VOCAB, None, seed=1).eval()
        tokens = torch.randint(0, 200, (2, 64))
        with torch.no_grad():
            model(tokens)                                                   # the table for length 64 exists now
            with HostWork() as w:
                model(tokens)
        return w

    two, five = forward_ops(2), forward_ops(5)
    for w in (two, five):
        rope_ops = {"aten.cos.default", "aten.sin.default", "aten.pow.Scalar", "aten.reciprocal.default"}
        assert not rope_ops & set(w.ops), w.ops
    per_layer = (five.total - two.total) / 3
    assert per_layer == 65, per_layer  # 78 before (13 of them RoPE's tables)
    a = rotary_table(64, 16, 10000.0, torch.float32, torch.device("cpu"))
    assert a is rotary_table(64, 16, 10000.0, torch.float32, torch.device("cpu"))      # shared, not recomputed
    assert a is not rotary_table(64, 16, 10000.0, torch.float64, torch.device("cpu"))  # per dtype


def test_a_table_made_in_inference_mode_still_trains():
    from training.models.gpt2 import GPTModel

    cfg = ModelConfig(num_layers=1, hidden_size=48, num_attention_heads=4, seq_length=29, vocab_size=200,
                      position_embedding="rope", hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, PADDED_VOCAB, None, seed=1)
    tokens = torch.randint(0, 200, (1, 29))
    with torch.inference_mode():                                            # e.g. an evaluation first
        model(tokens)
    model(tokens, tokens).mean().backward()                                 # then training on the same table
    assert model.layers[0].attn.qkv.weight.grad.abs().sum() > 0


def test_llama3_folder_imports_exports_and_is_adopted_by_init_from(tmp_path):
    """A saved ``LlamaForCausalLM`` folder with llama3 scaling: ``import_hf`` writes a run whose checkpoint keeps
    ``model.rope_scaling`` (logits equal ``transformers``), ``export_hf`` writes the scaling back, and a run
    started with ``train.init_from`` adopts it with the rest of the model shape."""
    transformers = pytest.importorskip("transformers")
    from tests.helpers.hf_models import GPT2_TOKENIZER, save_random_llama

    if not GPT2_TOKENIZER.is_dir():
        pytest.skip("../shared/data/tokenizers/gpt2 absent")
    from training.checkpoint_reader import load_model_for_eval
    from training.config import load_config
    from training.resolve import adopt_model_config
    from training.tools.export_hf import export
    from training.tools.import_hf import import_hf

    scaling = {"rope_type": "llama3", **SCALING}
    src = save_random_llama(tmp_path / "hf", rope_theta=500000.0, rope_scaling=scaling)
    run = import_hf(str(src), tmp_path / "run", seq_length=64)
    model, cfg, tok = load_model_for_eval(run)
    assert cfg.model.rope_scaling == RopeScalingConfig(**SCALING)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(src)).eval()
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog, twice, and then once more.")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :50257], hf(ids).logits, rtol=0, atol=1e-5)
    export(run, tmp_path / "back")
    again = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert {k: again.config.rope_parameters[k] for k in scaling} == scaling
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)
    new = load_config("configs/llama_tiny.yaml", ["data.corpus=x", f"train.init_from={run}",
                                                  f"run.dir={tmp_path / 'new'}", "parallel.tensor=1"])
    assert new.model.rope_scaling is None
    adopt_model_config(new)
    assert new.model.rope_scaling == RopeScalingConfig(**SCALING) and new.model.rotary_base == 500000.0


def test_megatron_use_rope_scaling_imports_and_exports_as_megatron_core_computes_it():
    """Megatron-Core's ``--use-rope-scaling`` (factor from ``--rope-scaling-factor``, the rest fixed): the model
    config our import reads from such args gives megatron-core's own ``RotaryEmbedding`` frequencies, and our export
    writes args that import back to the same scaling; values Megatron cannot express are refused in one line."""
    pytest.importorskip("megatron.core", reason="the test extra's megatron-core (Megatron's own modules)")
    import argparse

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from training.models.rotary import inverse_frequencies
    from training.tools.export_megatron import ExportMegatronError, megatron_args, refuse_unsupported
    from training.tools.import_megatron import llama_options

    args = argparse.Namespace(position_embedding_type="rope", rotary_base=500000, rotary_percent=1.0,
                              use_rope_scaling=True, rope_scaling_factor=16.0)
    options = llama_options(args)
    m = ModelConfig(arch="gpt", num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=64,
                    max_position_embeddings=64, vocab_size=PADDED_VOCAB, **options)
    head = m.hidden_size // m.num_attention_heads
    theirs = RotaryEmbedding(head, 1.0, rotary_base=500000, rope_scaling=True, rope_scaling_factor=16.0,
                             use_cpu_initialization=True).inv_freq
    ours = inverse_frequencies(head, m.rotary_base, m.llama3_rope_scaling)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert not torch.equal(ours, inverse_frequencies(head, m.rotary_base))  # the scaling changes some frequencies
    assert "rope_scaling" not in llama_options(argparse.Namespace(position_embedding_type="rope",
                                                                    use_rope_scaling=False))
    refuse_unsupported(m, 1)
    written = megatron_args(m, PADDED_VOCAB, 1, 1, 0, "core", None, False)
    assert (written.use_rope_scaling, written.rope_scaling_factor) == (True, 16.0)
    assert llama_options(written)["rope_scaling"] == m.rope_scaling
    other = ModelConfig(**{**vars(m), "rope_scaling": RopeScalingConfig(factor=8.0, original_max_position_embeddings=48)})
    with pytest.raises(ExportMegatronError, match="original_max_position_embeddings=48"):
        refuse_unsupported(other, 1)
