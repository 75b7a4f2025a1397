"""Real checkpoints (trained 2 steps at TP=1 and TP=2): HF export logits equal ours; the CLI end to end."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import SHARED_DATA, run_distributed

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # trains two tiny checkpoints in 2-process gloo runs (~1-2 min)
ROOT = Path(__file__).resolve().parents[2]
BOTCHAN = Path(SHARED_DATA) / "corpus" / "botchan.txt"
GPT2 = Path(SHARED_DATA) / "tokenizers" / "gpt2"
WT = Path(SHARED_DATA) / "eval" / "wikitext-103" / "wiki.test.tokens"


def _train(rank, world, overrides):
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", overrides))).train()
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not (BOTCHAN.is_file() and GPT2.is_dir()):
        pytest.skip("../shared/data corpus/tokenizer absent")
    spec = {"kind": "gpt2_bpe", "vocab_file": str((GPT2 / "gpt2-vocab.json").resolve()),
            "merges_file": str((GPT2 / "gpt2-merges.txt").resolve())}
    base = tmp_path_factory.mktemp("runs")
    out = {}
    for tp in (1, 2):
        ov = {"data.corpus": "null", "data.text_files": f"[{BOTCHAN}]", "data.tokenizer": json.dumps(spec),
              "run.dir": str(base / f"tp{tp}"), "train.progress_bar": "false", "model.seq_length": "32",
              "train.micro_batch_size": "2", "train.global_batch_size": str(2 * (2 // tp)), "train.iters": "2",
              "optimizer.warmup_iters": "1", "parallel.tensor": str(tp)}
        run_distributed(_train, 2, [f"{k}={v}" for k, v in ov.items()])
        out[tp] = base / f"tp{tp}"
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_export_loads_in_transformers_with_equal_logits(runs, tp, tmp_path):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from training.checkpoint_reader import load_model_for_eval
    from training.tools.export_hf import main

    assert main(["--checkpoint", str(runs[tp]), "--out", str(tmp_path / "hf")]) == 0
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model, cfg, tok = load_model_for_eval(runs[tp])
    text = "I am a native of Tokyo, and the son of a samurai."
    ids = tok.encode(text)
    assert hf_tok(text)["input_ids"] == ids
    assert hf.config.vocab_size == 50257 and model.padded_vocab_size > 50257
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x)[..., :50257], rtol=1e-4, atol=1e-4)
    assert main(["--checkpoint", str(runs[tp]), "--out", str(tmp_path / "hf")]) == 2  # exists: refused


def test_cli_wikitext_and_lambada(runs, tmp_path, capsys):
    from transformers import GPT2LMHeadModel

    from evaluation.cli import main
    from training.tools.export_hf import export

    raw = WT.read_text(encoding="utf-8")[:1200]
    (tmp_path / "small.tokens").write_text(raw, encoding="utf-8")
    assert main(["wikitext103", "--checkpoint", str(runs[2]), "--data", str(tmp_path / "small.tokens"),
                 "--stride", "8", "--json", str(tmp_path / "w.json"), "--no-progress"]) == 0
    res = json.loads((tmp_path / "w.json").read_text())
    assert "adjusted ppl" in capsys.readouterr().out
    # brute force with the exported HF model: every target once, window of L=32 ending at it, stride 8
    export(runs[2], tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    from evaluation.detokenizer import wikitext_detokenizer
    from megatron_ds_suite.core.tokenizer import GPT2BPETokenizer

    tok = GPT2BPETokenizer(GPT2 / "gpt2-vocab.json", GPT2 / "gpt2-merges.txt")
    ids = tok.encode(wikitext_detokenizer(raw))
    total = 0.0
    with torch.no_grad():
        for j in range(1, len(ids)):
            start = 0 if j <= 32 else ((j - 33) // 8 + 1) * 8
            lp = torch.log_softmax(hf(torch.tensor([ids[start:j]])).logits[0, -1].double(), -1)
            total -= float(lp[ids[j]])
    assert res["num_tokenized_tokens"] == len(ids)
    assert res["total_nll"] == pytest.approx(total, rel=1e-4)
    # LAMBADA: bad line reported with its number, before any model is loaded
    (tmp_path / "bad.jsonl").write_text('{"text": "a b c"}\n{oops\n')
    assert main(["lambada", "--checkpoint", str(runs[1]), "--data", str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:2: malformed JSON" in capsys.readouterr().err
    (tmp_path / "ok.jsonl").write_text('{"text": "the cat sat on the mat"}\n{"text": "I am a native of Tokyo"}\n')
    assert main(["lambada", "--checkpoint", str(runs[1]), "--data", str(tmp_path / "ok.jsonl"),
                 "--json", str(tmp_path / "l.json"), "--no-progress"]) == 0
    lres = json.loads((tmp_path / "l.json").read_text())
    assert lres["count"] == 2 and lres["mode"] == "strict"


def test_cli_limit_equals_main_job_cut_files(runs, tmp_path, capsys):
    """--limit N scores exactly what the main job (megatron_ds_suite.app.main_job) scores with its first-N-lines cut file."""
    from evaluation.cli import main
    from tests.helpers.eval_files import main_job_cut

    lambada_src = Path(SHARED_DATA) / "eval" / "lambada" / "lambada_test.jsonl"
    if not (WT.is_file() and lambada_src.is_file()):
        pytest.skip("../shared/data eval files absent")
    ck = ["--checkpoint", str(runs[1]), "--no-progress"]
    cut = main_job_cut(WT, 7, tmp_path / "mj")
    assert main(["wikitext103", *ck, "--data", str(WT), "--limit", "7", "--stride", "8",
                 "--json", str(tmp_path / "lim.json")]) == 0
    assert "WikiText perplexity (Megatron) (limited: first 7 lines)" in capsys.readouterr().out
    assert main(["wikitext103", *ck, "--data", str(cut), "--stride", "8", "--json", str(tmp_path / "cut.json")]) == 0
    lim, ref = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("lim", "cut"))
    assert lim["limit"] == 7 and ref["limit"] is None and lim["num_original_tokens"] > 100
    for k in ("total_nll", "num_tokenized_tokens", "num_original_tokens", "adjusted_ppl", "windows"):
        assert lim[k] == ref[k], k
    # LAMBADA: first 3 examples = main_job's first-3-lines file
    cut = main_job_cut(lambada_src, 3, tmp_path / "mj2", kind="lambada")
    assert main(["lambada", *ck, "--data", str(lambada_src), "--limit", "3", "--json", str(tmp_path / "l1.json")]) == 0
    assert "LAMBADA (limited: first 3 examples)" in capsys.readouterr().out
    assert main(["lambada", *ck, "--data", str(cut), "--json", str(tmp_path / "l2.json")]) == 0
    lim, ref = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("l1", "l2"))
    assert lim["count"] == ref["count"] == 3 and lim["limit"] == 3 and ref["limit"] is None
    for k in ("correct", "perplexity", "token_perplexity", "target_length_histogram"):
        assert lim[k] == ref[k], k
