"""BERT pretraining task + RACE fine-tuning: real RACE files, loss goes down, TP=2 run -> TP=1 scorer, bad input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers.corpora import RACE, SEQ, bert_cfg, botchan_docs, need, write_bert_corpus
from tests.helpers.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bert_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert_corpus")
    tok = write_bert_corpus(root, botchan_docs())
    return root, tok


# --------------------------------------------------------------------------------------------------
def test_real_race_files_encode_for_bert(bert_corpus):
    from megatron_ds_suite.core.race import clean_text, encode_questions, read_race_split

    _, tok = bert_corpus
    qs, report = read_race_split(need(RACE), "dev")
    assert len(qs) == 17 and report.skipped == 0
    samples = encode_questions(qs, tok, SEQ)
    raw = {}
    for f in sorted((RACE / "dev").glob("*/*.txt")):
        d = json.loads(f.read_text())
        for i, a in enumerate(d["answers"]):
            raw[f"{d.get('id', f.stem)}-{i}"] = "ABCD".index(a)
    for q, s in zip(qs, samples):
        assert s["label"] == raw[q.qid]
        assert s["text"].shape == (4, SEQ)
        art = tok.encode(clean_text(q.article))
        for k in range(4):
            row, types = s["text"][k], s["types"][k]
            seps = np.flatnonzero(row == tok.sep)
            assert row[0] == tok.cls and len(seps) == 2 and seps[1] == SEQ - 1  # articles fill the window
            qa = row[1:seps[0]].tolist()
            assert qa == tok.encode(clean_text(q.question.replace("_", q.options[k]) if "_" in q.question
                                               else q.question + " " + q.options[k]))[:128]
            assert row[seps[0] + 1:seps[1]].tolist() == art[:seps[1] - seps[0] - 1]
            assert (types[:seps[0] + 1] == 0).all() and (types[seps[0] + 1:] == 1).all()


def test_finetuning_a_tiny_model_lowers_the_loss(bert_corpus):
    from megatron_ds_suite.core.race import collate, encode_questions, read_race_split
    from training.models.bert import BertMultipleChoice
    from training.models.config import ModelConfig

    _, tok = bert_corpus
    qs, _ = read_race_split(need(RACE), "train")
    batch = collate(encode_questions(qs, tok, SEQ))
    cfg = ModelConfig(arch="bert", num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=SEQ,
                      hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = BertMultipleChoice(cfg, 1536, None, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)

    def loss_fn():
        return F.cross_entropy(model(batch["text"], batch["types"], batch["padding_mask"]), batch["label"])

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only contend
    try:
        with torch.no_grad():
            before = loss_fn().item()
        for _ in range(25):
            opt.zero_grad()
            loss = loss_fn()
            loss.backward()
            opt.step()
        with torch.no_grad():
            after = loss_fn().item()
    finally:
        torch.set_num_threads(threads)
    assert before == pytest.approx(np.log(4), abs=0.05)  # untrained: uniform over 4 options
    assert after < 0.7 * before, (before, after)


# --------------------------------------------------------------------------------------------------
def _e2e_worker(rank, world, corpus, pre_dir, ft_dir):
    import torch.distributed as dist

    from training.finetune_race import load_finetune_config, train_race
    from training.resolve import resolve_run
    from training.trainer import Trainer

    out = Trainer(resolve_run(bert_cfg(corpus, pre_dir))).train()
    dist.barrier()
    cfg, meta = load_finetune_config(ROOT / "configs" / "race.yaml", [
        f"finetune.pretrained={pre_dir}", f"finetune.race_dir={RACE}", f"run.dir={ft_dir}", "finetune.epochs=2",
        "optimizer.lr=1.0e-4", "train.progress_bar=false", "run.device_peak_tflops=1.0"])
    res = train_race(cfg, meta)
    return {"pretrain": out["last"], "race": res}


def test_pretrain_tp2_then_finetune_tp2_then_score_tp1(bert_corpus, tmp_path):
    from evaluation.race import race_accuracy
    from megatron_ds_suite.core.race import encode_questions, read_race_split
    from training.checkpoint_reader import load_model_for_eval

    corpus, _ = bert_corpus
    pre_dir, ft_dir = tmp_path / "pre", tmp_path / "ft"
    res = run_distributed(_e2e_worker, 2, corpus, pre_dir, ft_dir, timeout=240)[0]
    last = res["pretrain"]
    assert set(last) >= {"mlm_loss", "sop_loss"} and last["loss"] == pytest.approx(last["mlm_loss"] + last["sop_loss"],
                                                                                    rel=1e-5)
    assert 3.0 < last["mlm_loss"] < 8.0 and 0.3 < last["sop_loss"] < 1.2
    race = res["race"]
    assert [r["epoch"] for r in race["epochs"]] == [1, 2] and race["skipped_questions"]["dev"] == 0
    assert race["epochs"][0]["saved"] and json.loads((ft_dir / "race_results.json").read_text()) == race
    # the kept checkpoint (saved at TP=2) is the best dev epoch; merged to TP=1 it scores the same
    model, cfg, tok = load_model_for_eval(ft_dir)
    assert cfg.model.head == "multiple_choice" and model.num_choices == 4
    qs, _ = read_race_split(RACE, "dev")
    samples = encode_questions(qs, tok, SEQ)
    with torch.no_grad():
        acc = race_accuracy(samples, lambda b: model(b["text"], b["types"], b["padding_mask"]), progress=False)
    assert acc["count"] == 17
    assert acc["accuracy"] == pytest.approx(race["best"]["dev"]["accuracy"], abs=1e-9)
    # the CLI with --limit 13: the first 13 questions in read order (middle then high, files sorted by name)
    from evaluation.cli import main

    assert main(["race", "--checkpoint", str(ft_dir), "--data", str(RACE), "--split", "dev", "--limit", "13",
                 "--seq-length", str(SEQ), "--batch-size", "4", "--json", str(tmp_path / "race13.json"),
                 "--no-progress"]) == 0
    lim = json.loads((tmp_path / "race13.json").read_text())
    with torch.no_grad():
        acc13 = race_accuracy(samples[:13], lambda b: model(b["text"], b["types"], b["padding_mask"]), progress=False)
    assert lim["limit"] == 13 and lim["count"] == 13 and [q.level for q in qs[:13]] == ["middle"] * 11 + ["high"] * 2
    assert {k: lim[k] for k in acc13} == acc13
    # fine-tuning config errors, before any process group
    from training.config import ConfigError
    from training.finetune_race import load_finetune_config

    yaml_path = ROOT / "configs" / "race.yaml"
    base = [f"finetune.pretrained={pre_dir}", f"finetune.race_dir={RACE}"]
    with pytest.raises(ConfigError, match="already holds a fine-tuned checkpoint"):
        load_finetune_config(yaml_path, base + [f"run.dir={ft_dir}"])
    with pytest.raises(ConfigError, match="model.hidden_size comes from the pretrained checkpoint"):
        load_finetune_config(yaml_path, base + [f"run.dir={tmp_path / 'x'}", "model.hidden_size=128"])
    with pytest.raises(ConfigError, match="is the pretrained run"):
        load_finetune_config(yaml_path, base + [f"run.dir={pre_dir}"])
    with pytest.raises(ConfigError, match="finetune.pretrained"):
        load_finetune_config(yaml_path, [f"finetune.pretrained={tmp_path / 'nothing'}", f"run.dir={tmp_path / 'y'}",
                                         f"finetune.race_dir={RACE}"])
    cfg, _ = load_finetune_config(yaml_path, base + [f"run.dir={tmp_path / 'z'}", "model.hidden_dropout=0.2"])
    assert (cfg.model.hidden_size, cfg.model.hidden_dropout, cfg.model.head) == (32, 0.2, "multiple_choice")
    assert cfg.optimizer.lr == 1e-5 and cfg.finetune.epochs == 3 and cfg.parallel.tensor == 2


# --------------------------------------------------------------------------------------------------
def test_bad_bert_data_fails_at_once_with_a_clear_message(tmp_path):
    from training.config import ConfigError
    from training.tasks.bert import BertTask

    docs = botchan_docs()[:20]
    gpt_vocab = tmp_path / "gptvocab"
    write_bert_corpus(gpt_vocab, docs, flavor="gpt")
    with pytest.raises(ConfigError, match=r"lacks \[CLS\].*tokenizer.flavor=bert"):
        BertTask(bert_cfg(gpt_vocab, tmp_path / "r1"), None, 1)
    no_sentences = tmp_path / "nosent"
    write_bert_corpus(no_sentences, [[" ".join(d)] for d in docs])  # one item per document
    with pytest.raises(ConfigError, match="two or more sentences"):
        BertTask(bert_cfg(no_sentences, tmp_path / "r2"), None, 1)
    gpt_only = tmp_path / "gptonly"
    write_bert_corpus(gpt_only, docs, bert=False)
    with pytest.raises(ConfigError, match="has no BERT"):
        BertTask(bert_cfg(gpt_only, tmp_path / "r3"), None, 1)
    with pytest.raises(ConfigError, match="bert.masked_lm_prob"):
        BertTask(bert_cfg(gpt_only, tmp_path / "r4", {"bert": {"masked_lm_prob": 1.5}}), None, 1)


def _init_from_worker(rank, world, corpus, pre_dir, new_dir):
    from training.resolve import resolve_run
    from training.trainer import Trainer

    Trainer(resolve_run(bert_cfg(corpus, pre_dir, {"parallel": {"tensor": 1}, "train": {"iters": 1}}))).train()
    # another run of another configured shape, started from the first one's weights: 0 steps, then saved
    cfg = bert_cfg(corpus, new_dir, {"parallel": {"tensor": 1}, "model": {"num_layers": 1, "hidden_size": 64},
                                      "optimizer": {"warmup_iters": 0},
                                      "train": {"iters": 0, "init_from": str(pre_dir)}})
    Trainer(resolve_run(cfg)).train()
    return cfg.model.num_layers, cfg.model.hidden_size


def test_bert_run_starts_from_another_runs_weights(bert_corpus, tmp_path):
    """train.init_from for BERT: the new run adopts the source's shape and holds exactly its weights
    (encoder, MLM head with its vocabulary bias, pooler, SOP head) before its first step."""
    from training.checkpoint_reader import load_merged_state_dict, read_client_state

    corpus, _ = bert_corpus
    shape = run_distributed(_init_from_worker, 1, corpus, tmp_path / "pre", tmp_path / "new", timeout=240)[0]
    assert shape == (2, 32)
    a, _, _ = load_merged_state_dict(tmp_path / "pre")
    b, _, _ = load_merged_state_dict(tmp_path / "new")
    assert a.keys() == b.keys() and {"lm_head.bias", "binary_head.weight", "pooler.weight"} <= a.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert read_client_state(tmp_path / "new")["iteration"] == 0
