"""Vocabulary-parallel scores (TP=2) and data-parallel sharding equal the single-process numbers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from evaluation.lambada import LambadaExample, score_lambada
from evaluation.scoring import LMScorer, gpt2_scorer, token_scores
from evaluation.wikitext import WindowPlan, score_stream
from tests.helpers.distributed import run_distributed

V, VP = 300, 384


def _cfg():
    from training.models.config import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=V,
                       hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3)


def _data():
    g = torch.Generator().manual_seed(11)
    stream = torch.randint(0, V, (150,), generator=g).numpy()
    ex = [LambadaExample(torch.randint(0, V, (int(n),), generator=g).tolist(), torch.randint(0, V, (int(k),), generator=g).tolist())
          for n, k in zip(torch.randint(3, 20, (9,), generator=g), torch.randint(1, 4, (9,), generator=g))]
    return stream, ex


def _score_all(scorer, dp_rank=0, dp_world=1, dp_group=None):
    stream, ex = _data()
    s = score_stream(scorer, WindowPlan(stream, 32, 8, 0), batch_size=3, dp_rank=dp_rank, dp_world=dp_world,
                     dp_group=dp_group, progress=False)
    la = score_lambada(scorer, ex, 0, batch_size=4, dp_rank=dp_rank, dp_world=dp_world, dp_group=dp_group, progress=False)
    return s.total_nll, s.scored_tokens, la.correct, la.target_logprob


def _worker(rank, world):
    from training.models.gpt2 import GPTModel
    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState

    out = {}
    # TP = 2: each rank holds half of the padded vocabulary columns
    ps = ParallelState(tp=2)
    tp_random.configure(ps, num_layers=2)
    model = GPTModel(_cfg(), VP, ps.tp_group, seed=9).eval()
    out["tp"] = _score_all(LMScorer(model, V, 32, vocab_start=ps.tp_rank * VP // 2, tp_group=ps.tp_group))
    out["tp_head"] = _score_all(gpt2_scorer(model, V, 32, vocab_start=ps.tp_rank * VP // 2, tp_group=ps.tp_group))
    # raw token_scores with ties across ranks: the first global maximum wins, as torch.argmax
    z = torch.zeros(2, 3, VP)
    z[0, 0, [5, 200]] = 1.0   # tie across the two ranks -> 5
    z[1, 2, [250, 290]] = 2.0  # tie inside rank 1 -> 250
    z[0, 1, 350] = 9.0         # a padding column: ignored
    local = z[..., ps.tp_rank * VP // 2:(ps.tp_rank + 1) * VP // 2]
    out["ties"] = token_scores(local, torch.tensor([[5, 0, 0], [0, 0, 250]]), V, ps.tp_rank * VP // 2, ps.tp_group)
    # DP = 2: windows/examples split over the two processes, sums all-reduced
    ps1 = ParallelState(tp=1)
    model1 = GPTModel(_cfg(), VP, None, seed=9).eval()
    out["dp"] = _score_all(LMScorer(model1, V, 32), ps1.dp_rank, ps1.dims.dp, ps1.dp_group)
    return out


def test_tp2_and_dp2_equal_single_process():
    from training.models.gpt2 import GPTModel

    model = GPTModel(_cfg(), VP, None, seed=9).eval()
    ref = _score_all(LMScorer(model, V, 32))
    head = _score_all(gpt2_scorer(model, V, 32))  # output layer on the scored positions only
    assert head[0] == pytest.approx(ref[0], rel=1e-5) and head[1] == ref[1]
    np.testing.assert_array_equal(head[2], ref[2])
    z = torch.zeros(2, 3, VP)
    z[0, 0, [5, 200]] = 1.0
    z[1, 2, [250, 290]] = 2.0
    z[0, 1, 350] = 9.0
    ref_ties = token_scores(z, torch.tensor([[5, 0, 0], [0, 0, 250]]), V)
    assert ref_ties[1].tolist() == [[True, True, True], [True, True, True]]  # padding column 350 never wins
    results = run_distributed(_worker, 2)
    for r in results:
        for key in ("tp", "tp_head", "dp"):
            nll, n, correct, logprob = r[key]
            assert n == ref[1] == 149
            assert nll == pytest.approx(ref[0], rel=1e-5)
            np.testing.assert_array_equal(correct, ref[2])
            np.testing.assert_allclose(logprob, ref[3], rtol=1e-5)
        torch.testing.assert_close(r["ties"][0], ref_ties[0])
        assert torch.equal(r["ties"][1], ref_ties[1])
