"""Our strict LAMBADA scoring equals lm-evaluation-harness ``lambada_openai`` on an exported checkpoint.

A tiny GPT-2 is trained 2 steps (TP=1), exported with ``training.tools.export_hf`` and scored on the first
``K`` lines of the real ``lambada_test.jsonl`` (the file lm-eval pins by sha256) twice:

* ours: ``python -m evaluation lambada --strict`` (CLI, for the totals) and ``build_examples`` +
  ``score_lambada`` (per example);
* lm-eval: ``HFLM(pretrained=<export>)`` on a task config that is lm-eval's own installed
  ``lambada_openai.yaml`` (doc_to_text / doc_to_target / metrics untouched) with only the dataset
  source swapped to the local JSON file (no network).

Compared: number correct, the per-example greedy flag and target-word log-likelihood (lm-eval's
``log_samples`` responses), and the target-word perplexity. A 2-step model gets ~0 examples right,
so the per-example log-likelihoods are what make this test bite; the greedy flags must still match.
The 7 examples of the full file whose last word follows a newline are scored differently by design
(docs/evaluation.md) and are excluded where they fall in the first K (none do for K=200).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers.distributed import SHARED_DATA, run_distributed

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow  # trains a tiny checkpoint, then two scorers over K examples (~45 s)

ROOT = Path(__file__).resolve().parents[2]
LAMBADA = Path(SHARED_DATA) / "eval" / "lambada" / "lambada_test.jsonl"
BOTCHAN = Path(SHARED_DATA) / "corpus" / "botchan.txt"
GPT2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"
K = 200
# line indices (0-based) of the full file where the last word follows a newline: lm-eval splits on " ",
# strict mode on any whitespace, so context and target differ there (docs/evaluation.md)
NEWLINE_LAST_WORD = frozenset({426, 1053, 2881, 3047, 3977, 4351, 4462})


def _train(rank, world, overrides):
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", overrides))).train()
    return True


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    if not (LAMBADA.is_file() and BOTCHAN.is_file() and GPT2.is_dir()):
        pytest.skip("../shared/data (lambada_test.jsonl, botchan.txt, gpt2 tokenizer) absent")
    from training.tools.export_hf import export

    spec = {"kind": "gpt2_bpe", "vocab_file": str((GPT2 / "gpt2-vocab.json").resolve()),
            "merges_file": str((GPT2 / "gpt2-merges.txt").resolve())}
    run = tmp_path_factory.mktemp("lmeval") / "run"
    ov = {"data.corpus": "null", "data.text_files": f"[{BOTCHAN}]", "data.tokenizer": json.dumps(spec),
          "run.dir": str(run), "train.progress_bar": "false", "model.seq_length": "64",
          "train.micro_batch_size": "2", "train.global_batch_size": "2", "train.iters": "2",
          "optimizer.warmup_iters": "1", "parallel.tensor": "1"}
    run_distributed(_train, 1, [f"{k}={v}" for k, v in ov.items()])
    export(run, run.parent / "hf")
    return run, run.parent / "hf"


def _lmeval_task_dir(tmp_path: Path, data: Path) -> Path:
    """lm-eval's installed lambada_openai config, dataset source swapped to the local JSON file."""
    import lm_eval.tasks
    import yaml

    cfg = yaml.safe_load((Path(lm_eval.tasks.__file__).parent / "lambada" / "lambada_openai.yaml").read_text())
    assert cfg["doc_to_text"] == "{{text.split(' ')[:-1]|join(' ')}}"  # what the exclusions above assume
    assert cfg["doc_to_target"] == "{{' '+text.split(' ')[-1]}}"
    cfg.pop("tag", None)  # do not register a second "lambada" group member
    cfg.update(task="lambada_openai_local", dataset_path="json", dataset_name=None,
               dataset_kwargs={"data_files": {"test": str(data)}, "cache_dir": str(tmp_path / "hf_cache")})
    d = tmp_path / "lmeval_tasks"
    d.mkdir()
    (d / "lambada_openai_local.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return d


def _compare_with_lm_eval(run: Path, hf_dir: Path, tmp_path: Path, k: int, seq: int) -> dict:
    """lm-eval lambada_openai on the export vs our strict LAMBADA on the run, first ``k`` lines, per example."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from evaluation.cli import main
    from evaluation.lambada import build_examples, read_lambada_jsonl, score_lambada
    from evaluation.model import load_scorer, setup_runtime

    lines = LAMBADA.read_text(encoding="utf-8").splitlines(keepends=True)
    keep = [i for i in range(k) if i not in NEWLINE_LAST_WORD]
    n = len(keep)  # == k for k <= 426: none of the 7 newline examples is among the first 426
    data = tmp_path / "lambada_first_k.jsonl"
    data.write_text("".join(lines[i] for i in keep), encoding="utf-8")

    # ours: the CLI (totals) and the library (per example) on the same K lines
    assert main(["lambada", "--checkpoint", str(run), "--data", str(data), "--strict",
                 "--json", str(tmp_path / "ours.json"), "--no-progress"]) == 0
    ours = json.loads((tmp_path / "ours.json").read_text())
    scorer, _, tok = load_scorer(run, setup_runtime())
    texts = read_lambada_jsonl(data)
    sc = score_lambada(scorer, build_examples(texts, tok, strict=True), tok.eod, batch_size=8, progress=False)
    assert ours["count"] == n and ours["correct"] == int(sc.correct.sum())

    # lm-eval: its lambada_openai task on the same lines, exported model through HFLM
    lm = HFLM(pretrained=str(hf_dir), batch_size=8, device="cpu")
    assert lm.max_length == seq  # same left truncation (last seq + 1 tokens) as our scorer
    res = simple_evaluate(model=lm, tasks=["lambada_openai_local"], num_fewshot=0, limit=n,
                          task_manager=_local_task_manager(_lmeval_task_dir(tmp_path, data)),
                          log_samples=True, bootstrap_iters=0, verbosity="ERROR")
    theirs = res["results"]["lambada_openai_local"]
    samples = sorted(res["samples"]["lambada_openai_local"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(n))

    # per example: same (context, target) strings, same greedy flag, same target log-likelihood
    for i, s in enumerate(samples):
        ctx, tgt = s["arguments"][0]
        assert s["doc"]["text"] == texts[i]
        assert (ctx + tgt).split() == texts[i].split() and tgt.strip() == texts[i].split()[-1]
        ll, greedy = s["filtered_resps"][0]
        assert bool(greedy) == bool(sc.correct[i]) == bool(s["acc"]), f"example {i}: greedy flag differs"
        assert ll == pytest.approx(float(sc.target_logprob[i]), rel=1e-4, abs=1e-4), f"example {i}"

    n_theirs = round(theirs["acc,none"] * n)
    assert n_theirs == ours["correct"] == sum(int(s["acc"]) for s in samples)
    assert theirs["acc,none"] == pytest.approx(ours["accuracy"], abs=1e-12)
    # lm-eval's perplexity = exp(-mean target-word log-likelihood) = ours
    assert math.log(theirs["perplexity,none"]) == pytest.approx(math.log(ours["perplexity"]), rel=1e-5)
    return ours


def test_lambada_strict_equals_lm_eval_lambada_openai(exported, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ours = _compare_with_lm_eval(*exported, tmp_path, K, 64)
    assert ours["perplexity"] > 1000  # a 2-step model is bad; the comparison is of implementations


@pytest.fixture(scope="module")
def exported_sentencepiece(tmp_path_factory):
    """The main job's kind of run: a GPT-2 with a SentencePiece BPE (gpt flavour) tokenizer trained on the
    corpus. Random weights (std 0.2, written with training.tools.import_hf's checkpoint writer) instead of
    training keep it cheap: the comparison is of the two scorers and the exported tokenizer."""
    if not (LAMBADA.is_file() and BOTCHAN.is_file()):
        pytest.skip("../shared/data (lambada_test.jsonl, botchan.txt) absent")
    import shutil

    from data_pipeline.tokenizer_train import train_sentencepiece
    from training.config import Config
    from training.models.config import ModelConfig, padded_vocab_size
    from training.models.gpt2 import GPTModel
    from training.tools.export_hf import export
    from training.tools.import_hf import write_checkpoint

    root = tmp_path_factory.mktemp("lmeval_spm")
    tok = train_sentencepiece([BOTCHAN.read_text(encoding="utf-8")], root / "spm" / "gpt", 2000, "gpt")
    cfg = Config(model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=96,
                                   vocab_size=tok.vocab_size, init_method_std=0.2))
    model = GPTModel(cfg.model, padded_vocab_size(tok.vocab_size, 128, 1), seed=3)
    weights = {k: v[:tok.vocab_size] if k.endswith("word_embeddings.weight") else v for k, v in model.state_dict().items()}
    run = root / "run"
    (run / "tokenizer").mkdir(parents=True)
    shutil.copyfile(tok.model_file, run / "tokenizer" / "gpt.model")
    write_checkpoint(run, cfg, weights, {"kind": "sentencepiece", "model_file": "tokenizer/gpt.model"}, "random")
    export(run, root / "hf")
    return run, root / "hf"


def test_lm_eval_on_a_sentencepiece_export_equals_our_lambada(exported_sentencepiece, tmp_path, monkeypatch):
    """lm_eval runs on the export of a SentencePiece-tokenized run (the exported tokenizer.json is what
    lm-eval tokenizes with) and agrees with ``python -m evaluation lambada`` example by example."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ours = _compare_with_lm_eval(*exported_sentencepiece, tmp_path, 60, 96)
    assert ours["count"] == 60


def _local_task_manager(task_dir: Path):
    """lm-eval's TaskManager of the task files in ``task_dir`` alone, as ``python -m evaluation lm-eval`` builds it
    for local tasks (indexing lm-eval's ~14,000 installed task files as well takes 20-40 s a time)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir), include_defaults=False)


def _lm_eval_samples(lm, manager, task: str, n: int) -> tuple[dict, list[dict]]:
    from lm_eval import simple_evaluate

    res = simple_evaluate(model=lm, tasks=[task], num_fewshot=0, limit=n, task_manager=manager,
                          log_samples=True, bootstrap_iters=0, verbosity="ERROR")
    return res["results"][task], sorted(res["samples"][task], key=lambda s: s["doc_id"])


def _suite_lm_tp2(rank, world, run, pairs, task_dir, out):
    """At TP=2: SuiteLM's per-example log-likelihoods, then the command itself (last: it tears the groups down)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from evaluation.cli import main
    from evaluation.lm_eval_model import SuiteLM
    from evaluation.model import setup_runtime

    lm = SuiteLM.from_checkpoint(run, setup_runtime(2), batch_size=5)
    per_example = lm.loglikelihood([SimpleNamespace(args=tuple(p)) for p in pairs])
    dist.barrier()
    code = main(["lm-eval", "--tp", "2", "--checkpoint", run, "--tasks", "lambada_openai_local,wikitext_local",
                 "--lambada", str(LAMBADA), "--wikitext", str(WIKITEXT2), "--limit", "3", "--json", out])
    return per_example, code


WIKITEXT2 = Path(SHARED_DATA) / "eval" / "wikitext-2" / "wiki.test.tokens"


def test_lm_eval_on_our_checkpoint_equals_lm_eval_on_the_export(exported, tmp_path, monkeypatch):
    """SuiteLM (our checkpoint, no export) and lm-eval's HFLM (the export) on lm-eval's own lambada_openai and
    wikitext tasks (datasets swapped to the local files by ``python -m evaluation lm-eval``'s task writer):
    per-example log-likelihoods and greedy flags, the rolling log-likelihood of whole WikiText articles, at
    TP=1 and at TP=2 (the command under two ranks)."""
    if not WIKITEXT2.is_file():
        pytest.skip("../shared/data/eval/wikitext-2 absent")
    from lm_eval.models.huggingface import HFLM

    from evaluation.lm_eval_model import SuiteLM
    from evaluation.lm_eval_run import local_tasks
    from evaluation.model import setup_runtime

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    run, hf_dir = exported
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    assert local_tasks(task_dir, str(LAMBADA), str(WIKITEXT2)) == ["lambada_openai_local", "wikitext_local"]
    manager = _local_task_manager(task_dir)  # one index of the task files for every lm-eval call below
    n = 40
    ours_l, ours_s = _lm_eval_samples(SuiteLM.from_checkpoint(str(run), setup_runtime(), batch_size=7), manager, "lambada_openai_local", n)
    hf = HFLM(pretrained=str(hf_dir), batch_size=8, device="cpu")
    hf_l, hf_s = _lm_eval_samples(hf, manager, "lambada_openai_local", n)
    assert len(ours_s) == len(hf_s) == n
    for a, b in zip(ours_s, hf_s):
        assert a["arguments"] == b["arguments"]
        (ll_a, greedy_a), (ll_b, greedy_b) = a["filtered_resps"][0], b["filtered_resps"][0]
        assert ll_a == pytest.approx(ll_b, rel=1e-5, abs=1e-5) and bool(greedy_a) == bool(greedy_b)
    assert ours_l["acc,none"] == hf_l["acc,none"]
    assert ours_l["perplexity,none"] == pytest.approx(hf_l["perplexity,none"], rel=1e-5)

    # loglikelihood_rolling over whole articles (several 64-token windows each)
    ours_w, ours_ws = _lm_eval_samples(SuiteLM.from_checkpoint(str(run), setup_runtime(), batch_size=3), manager, "wikitext_local", 3)
    hf_w, hf_ws = _lm_eval_samples(hf, manager, "wikitext_local", 3)
    for a, b in zip(ours_ws, hf_ws):
        assert a["filtered_resps"][0] == pytest.approx(b["filtered_resps"][0], rel=1e-5)
    assert ours_w["word_perplexity,none"] == pytest.approx(hf_w["word_perplexity,none"], rel=1e-5)
    assert len(hf.tok_encode(ours_ws[0]["doc"]["page"])) > 3 * 64  # the rolling windows are exercised

    # TP=2: the same per-example numbers, and the command's table equal to TP=1's
    pairs = [a["arguments"][0] for a in ours_s]
    out = tmp_path / "tp2.json"
    for per_example, code in run_distributed(_suite_lm_tp2, 2, str(run), pairs, task_dir, str(out)):
        assert code == 0
        for (ll, greedy), a in zip(per_example, ours_s):
            assert ll == pytest.approx(a["filtered_resps"][0][0], rel=1e-5, abs=1e-5) and greedy == bool(a["filtered_resps"][0][1])
    tp2 = json.loads(out.read_text())["results"]
    _, first3 = _lm_eval_samples(SuiteLM.from_checkpoint(str(run), setup_runtime()), manager, "lambada_openai_local", 3)
    assert tp2["lambada_openai_local"]["acc,none"] == pytest.approx(sum(s["acc"] for s in first3) / 3)
    assert tp2["wikitext_local"]["word_perplexity,none"] == pytest.approx(ours_w["word_perplexity,none"], rel=1e-5)
