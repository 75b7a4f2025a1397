"""GPT-2 at TP=2 equals TP=1; dropout reproducibility; activation checkpointing; collective counts."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from training.models.config import ModelConfig

PADDED_VOCAB = 256  # same padded vocabulary at TP=1 and TP=2 (128 x 2), so weights agree exactly


def _cfg(dropout=0.0, ckpt=False, layers=2):
    return ModelConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=200,
                       hidden_dropout=dropout, attention_dropout=dropout, activation_checkpointing=ckpt)


def _batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 200, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _run_model(model, tokens, labels):
    logits = model(tokens).detach()
    loss = model(tokens, labels).mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits, loss.detach(), grads


def _tp_worker(rank, world, dropout, ckpt):
    from training.models.gpt2 import GPTModel
    from training.parallel import random as tp_random
    from training.parallel.mappings import COLLECTIVE_CALLS
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=world)
    tp_random.configure(ps, num_layers=2)
    tp_random.set_seed(1234)
    model = GPTModel(_cfg(dropout, ckpt), PADDED_VOCAB, ps.tp_group, seed=1234)
    tokens, labels = _batch()
    if dropout == 0.0:
        model.eval()  # dropout off; eval() does not change anything else in this model
        # count collectives in one transformer layer, forward and backward
        x = torch.randn(2, 16, 64, requires_grad=True)
        COLLECTIVE_CALLS.clear()
        y = model.layers[0](x)
        fwd = dict(COLLECTIVE_CALLS)
        COLLECTIVE_CALLS.clear()
        y.sum().backward()
        bwd = dict(COLLECTIVE_CALLS)
        model.zero_grad()
        logits, loss, grads = _run_model(model, tokens, labels)
        return {"logits": logits, "loss": loss, "grads": grads, "fwd": fwd, "bwd": bwd,
                "tags": {n: (getattr(p, "partition_dim", None), getattr(p, "partition_stride", None))
                         for n, p in model.named_parameters()}}
    # dropout on: two identical runs from the same seed, plus the per-rank attention-dropout seed
    model.train()
    out = []
    for _ in range(2):
        tp_random.set_seed(1234)
        model.zero_grad()
        loss = model(tokens, labels).mean()
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    tracker_seed = tp_random.get_tracker().seeds_ if hasattr(tp_random.get_tracker(), "seeds_") else None
    return {"runs": out, "tracker_seeds": sorted(tracker_seed) if tracker_seed else None}


def _merge(name, shards, tags):
    dim, stride = tags[name]
    if dim is None:
        return shards[0]
    stride = stride or 1
    pieces = [s.chunk(stride, dim) for s in shards]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(len(shards))], dim)


def test_gpt2_tp2_equals_tp1():
    from training.models.gpt2 import GPTModel

    ref = GPTModel(_cfg(), PADDED_VOCAB, None, seed=1234).eval()
    tokens, labels = _batch()
    logits, loss, grads = _run_model(ref, tokens, labels)
    res = run_distributed(_tp_worker, 2, 0.0, False)
    tags = res[0]["tags"]
    torch.testing.assert_close(res[0]["loss"], loss, rtol=1e-5, atol=1e-6)
    full_logits = torch.cat([r["logits"] for r in res], -1)
    torch.testing.assert_close(full_logits, logits, rtol=1e-4, atol=1e-5)
    for name, g in grads.items():
        merged = _merge(name, [r["grads"][name] for r in res], tags)
        torch.testing.assert_close(merged, g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        if tags[name][0] is not None:  # each shard is the matching slice of the serial gradient
            assert res[0]["grads"][name].numel() * 2 == g.numel()
    # replicated parameters (LayerNorm, row bias, positions) get identical grads on both ranks
    torch.testing.assert_close(res[0]["grads"]["layers.0.ln1.weight"], res[1]["grads"]["layers.0.ln1.weight"],
                               rtol=0, atol=0)
    # exactly two all-reduces per layer forward and two backward
    assert res[0]["fwd"] == {"all_reduce": 2}, res[0]["fwd"]
    assert res[0]["bwd"] == {"all_reduce": 2}, res[0]["bwd"]
    assert tags["layers.0.attn.qkv.weight"] == (0, 3)
    assert tags["layers.0.mlp.proj.weight"] == (1, 1)
    assert tags["layers.0.mlp.proj.bias"] == (None, None)


def test_dropout_reproducible_and_checkpointing_changes_nothing():
    plain = run_distributed(_tp_worker, 2, 0.1, False)
    ckpt = run_distributed(_tp_worker, 2, 0.1, True)
    for rank in range(2):
        (l1, g1), (l2, g2) = plain[rank]["runs"]
        torch.testing.assert_close(l1, l2, rtol=0, atol=0)
        for n in g1:
            torch.testing.assert_close(g1[n], g2[n], rtol=0, atol=0)
        (lc, gc), _ = ckpt[rank]["runs"]
        torch.testing.assert_close(lc, l1, rtol=0, atol=0)
        for n in g1:
            torch.testing.assert_close(gc[n], g1[n], rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")
    # attention dropout differs between TP ranks (different heads, different stream) ...
    assert not torch.equal(plain[0]["runs"][0][1]["layers.0.attn.qkv.weight"],
                           plain[1]["runs"][0][1]["layers.0.attn.qkv.weight"])
    # ... and the loss (computed over the whole vocabulary) is the same on both ranks
    torch.testing.assert_close(plain[0]["runs"][0][0], plain[1]["runs"][0][0], rtol=0, atol=0)


def _seed_worker(rank, world):
    import deepspeed

    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=world)
    tp_random.configure(ps, num_layers=1)
    tp_random.set_seed(12345)
    default = torch.initial_seed()
    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    with tracker.fork():
        in_fork = torch.initial_seed()
        draw = torch.rand(3)
    ref = torch.Generator().manual_seed(12345 + 2718 + rank)
    return default, in_fork, torch.equal(draw, torch.rand(3, generator=ref))


def test_model_parallel_seed_offset():
    for rank, (default, in_fork, same) in enumerate(run_distributed(_seed_worker, 2)):
        assert default == 12345
        assert in_fork == 12345 + 2718 + rank
        assert same


@pytest.mark.parametrize("world,tp", [(4, 2)])
def test_group_layout_matches_deepspeed_topology(world, tp):
    res = run_distributed(_layout_worker, world, tp)
    # TP adjacent, DP strided (Megatron / PipeModelDataParallelTopology order)
    assert [r["tp_ranks"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [(r["tp_rank"], r["dp_rank"]) for r in res] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def _layout_worker(rank, world, tp):
    import torch.distributed as dist

    from training.parallel.state import ParallelState

    ps = ParallelState(tp=tp)
    return {"tp_ranks": dist.get_process_group_ranks(ps.get_model_parallel_group()),
            "dp_ranks": dist.get_process_group_ranks(ps.get_data_parallel_group()),
            "tp_rank": ps.get_tensor_model_parallel_rank(), "dp_rank": ps.get_data_parallel_rank()}


def test_parallel_dims_validated_without_process_groups():
    from megatron_ds_suite.core.errors import ConfigError
    from training.parallel.state import ParallelDims

    assert ParallelDims(8, tp=2, pp=2).dp == 2
    assert ParallelDims(8, tp=2).coords(5) == (0, 2, 1)
    with pytest.raises(ConfigError, match="not divisible by TP x PP"):
        ParallelDims(6, tp=4)
