"""``model.recompute: none | selective | full`` (issue 28 item 4): selective recomputes only the attention core.

With dropout on (the CPU path whose attention core keeps the s x s probabilities, their mask and output),
none, selective and full give the same loss and the same gradients, bit for bit, at TP 1 and TP 2, for the
GPT-2 block, the Llama-style block (RoPE, grouped-query attention: the recomputed region starts before the
key/value repeat) and BERT (padding mask); the dropout masks inside the recomputed core are replayed from the
model-parallel tracker's stream. What selective saves is measured in ``tests/parallel/test_plan_activations.py``.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import needs_corpus, tiny_overrides, train_worker
from training.config import ConfigError, config_from_dict
from training.models.config import ModelConfig

VOCAB = 256
MODES = ("none", "selective", "full")
SHAPES = {
    "gpt2": dict(),
    "llama": dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu", num_query_groups=2,
                  untie_embeddings_and_output_weights=True, add_bias_linear=False),
    "bert": dict(arch="bert"),
}


def _cfg(shape: str, recompute: str) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=200,
                       hidden_dropout=0.1, attention_dropout=0.1, recompute=recompute, **SHAPES[shape])


def _loss(model, shape: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 200, (2, 33), generator=g)
    if shape != "bert":
        return model(tokens[:, :-1], tokens[:, 1:]).mean()
    from training.models.bert import BertModel

    assert isinstance(model, BertModel)
    types = torch.zeros(2, 32, dtype=torch.long)
    padding = torch.ones(2, 32, dtype=torch.long)
    padding[1, 20:] = 0                                                  # the second sample is padded
    lm_loss, sop_logits = model(tokens[:, :-1], types, padding, lm_labels=tokens[:, 1:])
    return lm_loss.mean() + sop_logits.mean()


def _worker(rank: int, world: int) -> dict:
    from training.models.bert import BertModel
    from training.models.gpt2 import GPTModel
    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=world)
    tp_random.configure(ps, num_layers=2)
    out: dict = {}
    for shape in SHAPES:
        for mode in MODES:
            cfg = _cfg(shape, mode)
            build = BertModel if shape == "bert" else GPTModel
            model = build(cfg, VOCAB, ps.tp_group, seed=1234).train()
            tp_random.set_seed(99)  # same default and tracker streams for every mode
            loss = _loss(model, shape)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            # the streams end where they end without recomputation: the replay rewinds nothing
            after = (torch.get_rng_state(), tp_random.get_tracker().get_states()[tp_random.MODEL_PARALLEL_RNG])
            out[shape, mode] = (loss.detach(), grads, after)
    tp_random.set_seed(100)
    out["reseeded"] = _loss(GPTModel(_cfg("gpt2", "none"), VOCAB, ps.tp_group, seed=1234).train(), "gpt2").detach()
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_none_selective_full_give_the_same_loss_and_gradients(tp):
    ranks = run_distributed(_worker, tp)
    for r in ranks:
        for shape in SHAPES:
            loss, grads, after = r[shape, "none"]
            assert len(grads) > 10
            for mode in ("selective", "full"):
                loss_m, grads_m, after_m = r[shape, mode]
                assert torch.equal(loss_m, loss), (shape, mode, loss_m, loss)
                assert grads_m.keys() == grads.keys()
                for name, g in grads.items():
                    assert torch.equal(grads_m[name], g), (shape, mode, name, (grads_m[name] - g).abs().max())
                assert torch.equal(after_m[0], after[0]) and torch.equal(after_m[1], after[1]), (shape, mode)
    # dropout is on: other masks give another loss (the equalities above are not vacuous)
    assert abs(float(ranks[0]["reseeded"]) - float(ranks[0]["gpt2", "none"][0])) > 1e-4


def test_selective_recomputes_the_core_only_where_it_keeps_scores():
    """The recomputed region runs where the core keeps s x s tensors (CPU with attention dropout, Megatron's
    fp16 core) and not with SDPA's fused kernel (CPU without dropout), where selective is none."""
    from training.models.blocks import TransformerLayer
    from training.parallel import random as tp_random

    calls = []
    real = tp_random.recompute

    def counting(fn, *tensors):
        calls.append(len(tensors))
        return real(fn, *tensors)

    x = torch.randn(2, 32, 64, requires_grad=True)
    tp_random.recompute = counting
    try:
        for dropout, extra, expected in ((0.1, {}, 1), (0.0, {}, 0), (0.0, {"attention_softmax_in_fp32": True}, 1)):
            cfg = ModelConfig(hidden_size=64, num_attention_heads=4, seq_length=32, attention_dropout=dropout,
                              recompute="selective", **extra)
            layer = TransformerLayer(cfg, None, 1, 0).train()
            calls.clear()
            layer(x).sum().backward()
            assert calls == [3] * expected, (dropout, extra, calls)
            with torch.no_grad():                                       # no graph: nothing to recompute
                calls.clear()
                layer(x)
                assert calls == []
    finally:
        tp_random.recompute = real


def test_recompute_replays_both_streams():
    """``tp_random.recompute`` alone: a region drawing from the default generator gives the gradient of the
    same region run with its graph, and leaves the generator where that run leaves it."""
    from training.parallel import random as tp_random

    def region(a):
        return torch.nn.functional.dropout(a.exp(), 0.5, True) * a

    a = torch.randn(64, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)
    region(a).sum().backward()
    ref, ref_state = a.grad.clone(), torch.get_rng_state()
    a.grad = None
    torch.manual_seed(5)
    tp_random.recompute(region, a).sum().backward()
    assert torch.equal(a.grad, ref) and torch.equal(torch.get_rng_state(), ref_state)


@pytest.mark.parametrize("old,new", [(True, "full"), (False, "none"), ("auto", "auto")])
def test_old_key_still_accepted(old, new):
    cfg = config_from_dict({"model": {"activation_checkpointing": old}})
    assert cfg.model.recompute == new and cfg.model.activation_checkpointing is None
    # a saved config (RUN_DIR/config.json) loads back the same
    assert config_from_dict(cfg.to_dict()).model.recompute == new


def test_old_key_on_the_command_line_wins_over_the_file():
    """configs/gpt2_1.2b.yaml says ``recompute: auto``; an old command line still forces it, and the newest
    of the two spellings wins."""
    from training.plan.cli import load_plan_config

    def recompute(*overrides):
        return load_plan_config("configs/gpt2_1.2b.yaml", None, list(overrides)).model.recompute

    assert recompute() == "auto"
    assert recompute("model.activation_checkpointing=true") == "full"
    assert recompute("model.activation_checkpointing=false") == "none"
    assert recompute("model.activation_checkpointing=true", "model.recompute=selective") == "selective"
    assert recompute("model.recompute=selective", "model.activation_checkpointing=true") == "full"


def test_old_and_new_key_disagreeing_is_one_line():
    with pytest.raises(ConfigError, match=r"model.activation_checkpointing=true \(the old key\) disagrees with "
                                          r"model.recompute=selective: set only model.recompute") as e:
        config_from_dict({"model": {"activation_checkpointing": True, "recompute": "selective"}})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="model.recompute: 'some' is not one of 'none', 'selective'"):
        config_from_dict({"model": {"recompute": "some"}})
    with pytest.raises(ConfigError, match="model.activation_checkpointing: 'yes' is not true, false or auto"):
        config_from_dict({"model": {"activation_checkpointing": "yes"}})
    with pytest.raises(ConfigError, match="disagrees"):
        ModelConfig(activation_checkpointing=False, recompute="full")


def _train_each(rank, world, runs):
    """Rank worker: ``train_worker`` for each overrides list of ``runs``, one after the other."""
    return [train_worker(rank, world, overrides) for overrides in runs]


@needs_corpus
def test_selective_under_pipeline_parallelism_trains_as_none(spm_model, tmp_path):  # noqa: F811 - fixture
    """PP = 2 under the Trainer with dropout on: selective recomputation gives the losses of none, bit for bit
    (the recomputed cores replay their dropout masks inside DeepSpeed's pipeline schedule)."""
    common = {"train.iters": 3, "parallel.tensor": 1, "parallel.pipeline": 2, "model.hidden_dropout": 0.1,
              "model.attention_dropout": 0.1}
    modes = ("none", "selective")
    runs = [tiny_overrides(spm_model, tmp_path / mode, **common, **{"model.recompute": mode}) for mode in modes]
    losses = {mode: out["losses"] for mode, out in zip(modes, run_distributed(_train_each, 2, runs, timeout=600)[0])}  # one launch
    assert len(losses["none"]) == 3 and losses["selective"] == losses["none"], losses


def test_planner_selective_memory_and_flops_for_the_8p3b_model_at_tp8():
    """Korthikanti et al. 2022, Table 2 without sequence parallelism: selective keeps s b h (10 + 24/t) per layer,
    the s^2 term 5 a s / (h t) gone; for the 8.3B config at TP 8 (micro-batch 8, fp16, attention scores kept) that
    is 33.50 -> 22.25 GiB of activations per device, for 4 B s^2 h l recomputed FLOPs: +1.72 % of the step
    (full recomputation: +32.7 %)."""
    from training.layout import Layout
    from training.plan.accounting import recomputed_flops, step_flops
    from training.plan.memory import GIB, activation_bytes_per_layer, memory
    from training.plan.presets import preset_shape

    s = preset_shape("gpt2-8.3b", 8)
    sbh = 1024 * 8 * 3072
    assert activation_bytes_per_layer(s, 8, 8) == pytest.approx(sbh * (10 + 24 / 8 + 5 * 32 * 1024 / (3072 * 8)))
    assert activation_bytes_per_layer(s, 8, 8, scores_stored=False) == pytest.approx(sbh * (10 + 24 / 8))
    lay = Layout(tp=8, pp=1, dp=1, micro_batch=8, global_batch=512)
    mem = memory(s, lay, "fp16")
    assert (round(mem.activations / GIB, 2), round(mem.activations_selective / GIB, 2),
            round(mem.activations_ckpt / GIB, 2)) == (33.50, 22.25, 4.15)
    assert mem.activations - mem.activations_selective == pytest.approx(72 * sbh * 5 * 32 * 1024 / (3072 * 8))
    assert mem.total_for(False, "selective") == mem.total(False, False) - (mem.activations - mem.activations_selective)
    # fused attention keeps no scores: selective is none
    flash = memory(s, lay, "fp16", scores_stored=False)
    assert flash.activations_selective == flash.activations
    tokens = 512 * 1024
    assert recomputed_flops(s, 512, "selective") == 72 * 4 * tokens * 1024 * 3072
    assert recomputed_flops(s, 512, "full") == step_flops(s, 512, True) - step_flops(s, 512, False)
    assert recomputed_flops(s, 512, "none") == 0
    base = step_flops(s, 512, False)
    assert round(100 * recomputed_flops(s, 512, "selective") / base, 2) == 1.72
    assert round(100 * recomputed_flops(s, 512, "full") / base, 1) == 32.7


def _compiled_worker(rank: int, world: int) -> dict:
    from training.models.blocks import TransformerLayer
    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=world)
    tp_random.configure(ps, num_layers=1)
    out: dict = {"recomputed": 0}
    real = tp_random.recompute

    def counting(fn, *tensors):
        out["recomputed"] += 1
        return real(fn, *tensors)

    tp_random.recompute = counting
    for mode in ("none", "selective"):
        cfg = ModelConfig(hidden_size=64, num_attention_heads=4, seq_length=32, hidden_dropout=0.0,
                          attention_dropout=0.1, recompute=mode)
        layer = TransformerLayer(cfg, ps.tp_group, 1, 0).train()
        layer.compile(backend="aot_eager")                                # model.compile's per-layer compile
        x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        tp_random.set_seed(7)
        layer(x).square().sum().backward()
        out[mode] = [x.grad] + [p.grad for p in layer.parameters()]
    return out


def test_selective_in_compiled_layers():
    """``model.compile``: the recomputed core runs eagerly between the layer's graphs, drawing its attention
    dropout from the compiled path's counter-based mask, and gives the gradients of compiled layers without
    recomputation, bit for bit."""
    out = run_distributed(_compiled_worker, 1)[0]
    assert out["recomputed"] == 1
    for a, b in zip(out["none"], out["selective"], strict=True):
        assert torch.equal(a, b)
