"""Resharding TP=2,PP=2 -> TP=1,PP=1 -> TP=4 keeps the model; training resumed from a converted
checkpoint continues with the original losses."""
from __future__ import annotations

import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import metric_steps, needs_corpus, tiny_overrides, train_stages


def _logits(rank, world, dirs_and_tags):
    from training.checkpoint_reader import load_model_for_eval

    tokens = (torch.arange(32).view(1, 32) * 7) % 1000
    return [load_model_for_eval(d, tag=t)[0](tokens)[..., :1000].detach() for d, t in dirs_and_tags]


def _logits_then_train(rank, world, dirs_and_tags, overrides):
    """One-rank worker: the logits of ``dirs_and_tags``, then a run with ``overrides`` (one launch for both)."""
    logits = _logits(rank, world, dirs_and_tags)
    train_stages(rank, world, overrides, [[]])
    return logits


@needs_corpus
def test_reshard_tp2pp2_to_tp1_to_tp4(spm_model, tmp_path):
    from training.tools.reshard import reshard

    common = {"train.iters": 4, "optimizer.lr": 3e-3, "optimizer.warmup_iters": 2, "train.global_batch_size": 4}
    a = tmp_path / "a"
    over = tiny_overrides(spm_model, a, **{"parallel.tensor": 2, "parallel.pipeline": 2}, **common)
    run_distributed(train_stages, 4, over, [["train.exit_at=2"], []])  # stop at 2, then continue to 4
    b, c = tmp_path / "b", tmp_path / "c"
    reshard(a, tp=1, pp=1, out=b, tag="iter_0000002")
    reshard(b, tp=4, pp=1, out=c)
    # the three checkpoints' logits, then the TP=1 conversion resumed to iteration 4 (after its logits were taken)
    la, lb, lc = run_distributed(_logits_then_train, 1, [(str(a), "iter_0000002"), (str(b), None), (str(c), None)],
                                 tiny_overrides(spm_model, b, **{"parallel.tensor": 1}, **common), timeout=600)[0]
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lc, la, rtol=1e-5, atol=1e-5)
    # the resumed TP=1 conversion: same losses and learning rates as the original run
    sa, sb = metric_steps(a), metric_steps(b)
    assert sorted(sb) == [1, 2, 3, 4]
    for it in (3, 4):
        assert abs(sb[it][0] - sa[it][0]) < 2e-4, (it, sa[it], sb[it])
        assert sb[it][1] == sa[it][1]


def _bert_stages(rank, world, corpus, run_dir, tp, stages):
    from tests.helpers.corpora import bert_cfg
    from training.resolve import resolve_run
    from training.trainer import Trainer

    for extra in stages:
        Trainer(resolve_run(bert_cfg(corpus, run_dir, {"parallel": {"tensor": tp}, **extra}))).train()
    return None


def test_reshard_bert_tp2_to_tp1_resumes_with_the_same_loss(tmp_path, tmp_path_factory):
    """BERT (vocabulary 1500 pads to 1536 at TP=1 and TP=2): the converted run continues the original."""
    from tests.helpers.corpora import botchan_docs, write_bert_corpus
    from training.tools.reshard import reshard

    corpus = tmp_path_factory.mktemp("bert_corpus_reshard")
    write_bert_corpus(corpus, botchan_docs())
    a, b = tmp_path / "a", tmp_path / "b"
    run_distributed(_bert_stages, 2, str(corpus), str(a), 2, [{"train": {"exit_at": 2}}, {}])
    reshard(a, tp=1, pp=1, out=b, tag="iter_0000002")
    run_distributed(_bert_stages, 1, str(corpus), str(b), 1, [{}])
    sa, sb = metric_steps(a), metric_steps(b)
    assert sorted(sb) == [1, 2, 3]
    assert abs(sb[3][0] - sa[3][0]) < 2e-4 and sb[3][1] == sa[3][1], (sa, sb)
