"""The planner's per-rank parameter count against the project's own GPTModel sharded over 2 gloo ranks
(the single-process planner tests are tests/unit/test_plan.py)."""
from __future__ import annotations

from training.models.config import ModelConfig
from training.plan.accounting import ModelShape, stage_params


def _tp_rank_numel(rank, world):
    import torch.distributed as dist

    from training.models.gpt2 import GPTModel
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=64,
                      make_vocab_size_divisible_by=8)
    model = GPTModel(cfg, 64, group=dist.group.WORLD, seed=1)
    return sum(p.numel() for p in model.parameters())


def test_tp_shard_params_match_project_gpt2_shards():
    from tests.helpers.distributed import run_distributed

    counts = run_distributed(_tp_rank_numel, 2, timeout=120)
    shape = ModelShape("gpt2", num_layers=2, hidden=16, heads=4, seq=8, vocab=64, positions=8, ffn=64)
    assert counts == [stage_params(shape, 2, 1)[0]] * 2


