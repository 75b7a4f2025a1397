"""WikiText-103 evaluation: detokenizer on real lines, counts on the real files (evaluation.md §2),
window coverage against a direct port of Megatron's _LMDataset, perplexity vs brute force."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation.detokenizer import wikitext_detokenizer
from evaluation.errors import EvalError
from evaluation.scoring import LMScorer
from evaluation.tasks import wikitext_eval
from evaluation.wikitext import WindowPlan, count_original_tokens, lines_to_tokens_text, read_tokens_file, score_stream

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
WT103 = DATA / "eval" / "wikitext-103"
GPT2 = DATA / "tokenizers" / "gpt2"


def _need(p: Path) -> Path:
    if not p.exists():
        pytest.skip(f"shared data {p} is absent")
    return p


@pytest.fixture(scope="module")
def gpt2_tok():
    from megatron_ds_suite.core.tokenizer import GPT2BPETokenizer

    _need(GPT2)
    return GPT2BPETokenizer(GPT2 / "gpt2-vocab.json", GPT2 / "gpt2-merges.txt")


# ------------------------------------------------------------------------------------------------
# detokenizer
# ------------------------------------------------------------------------------------------------
def test_detokenizer_real_lines():
    lines = _need(WT103 / "wiki.test.tokens").read_text(encoding="utf-8").split("\n")
    assert lines[1] == " = Robert Boulter = "
    assert wikitext_detokenizer(lines[1] + "\n") == " = Robert Boulter =\n"
    assert wikitext_detokenizer(" = = Career = = \n") == " == Career ==\n"
    # number separators, punctuation, brackets, quotes and possessives on real lines of the file
    line = next(x for x in lines if "2 @,@ 000" in x)
    assert "2,000" in wikitext_detokenizer(line) and " @,@ " not in wikitext_detokenizer(line)
    line3 = lines[3]
    assert line3.startswith(" Robert Boulter is an English film , television and theatre actor . He had a guest @-@ starring")
    out3 = wikitext_detokenizer(line3)
    assert out3.startswith(" Robert Boulter is an English film, television and theatre actor. He had a guest-starring")
    # a quoted title: the spaces inside the quotes go, outside stay
    assert wikitext_detokenizer('the play " Herons " , which') == 'the play "Herons", which'
    assert wikitext_detokenizer("( born 1984 ) x") == "(born 1984) x"
    assert wikitext_detokenizer("Boulter 's role") == "Boulter's role"
    assert wikitext_detokenizer("the actors ' union") == "the actors' union"
    assert wikitext_detokenizer("5 @.@ 5 ° C") == "5.5°C"
    # rule 2 is a no-op on purpose (literal slashes in Megatron's pattern)
    assert wikitext_detokenizer("rock ' 7 roll") == "rock ' 7 roll"
    # quote pairing runs over the whole stream, across lines (known quirk kept verbatim)
    assert wikitext_detokenizer("a \" b\nc \" d") == 'a "b\nc" d'


@pytest.mark.parametrize("name,chars,start", [
    ("wiki.test.tokens", 1_229_299, "\n= Robert Boulter =\n\nRobert Boulter is an English film, television and theatre a"),
    ("wiki.valid.tokens", 1_097_358, "\n= Homarus gammarus =\n\nHomarus gammarus, known as"),
])
def test_detokenized_whole_file(name, chars, start):
    raw = read_tokens_file(_need(WT103 / name))
    out = wikitext_detokenizer(raw)
    assert len(out) == chars
    assert out.startswith(start)


# ------------------------------------------------------------------------------------------------
# counts on the real test file
# ------------------------------------------------------------------------------------------------
def test_real_counts_test_file(gpt2_tok):
    raw = read_tokens_file(_need(WT103 / "wiki.test.tokens"))
    assert len(raw) == 1_279_333
    assert count_original_tokens(raw) == 245_566
    assert len(raw.split()) == 241_211
    ids = gpt2_tok.encode(wikitext_detokenizer(raw))
    assert len(ids) == 270_330
    plan = WindowPlan(np.asarray(ids), 1024, 32, gpt2_tok.eod)
    assert plan.num_windows_megatron == 8_448
    assert abs((len(ids) - 1) / (245_566 - 1) - 1.10084) < 5e-6
    # every target scored exactly once over the real stream
    cover = np.zeros(len(ids), dtype=np.int64)
    for i in range(plan.num_windows):
        _, lab, mask = plan.window(i)
        t = i * 32 + np.nonzero(mask)[0] + 1
        cover[t] += 1
    assert cover[0] == 0 and (cover[1:] == 1).all()


def test_hf_rows_rebuild_the_tokens_file():
    raw = read_tokens_file(_need(WT103 / "wiki.test.tokens"))
    # datasets' wikitext rows: the lines with "\n" kept, blank lines (" \n") stored as ""
    rows = ["" if ln == " \n" else ln for ln in raw.splitlines(keepends=True)]
    assert lines_to_tokens_text(rows) == raw


# ------------------------------------------------------------------------------------------------
# windows vs a direct port of Megatron's _LMDataset (trailing padding-only windows included)
# ------------------------------------------------------------------------------------------------
def _megatron_lm_dataset(tokens, seq_len, pad, stride):
    total_targets = len(tokens) - 1
    targets = max(total_targets - stride, 0)
    n = max(math.ceil(targets / stride) + 1, 1)
    out = []
    for idx in range(n):
        start = idx * stride
        toks = list(tokens[start : start + seq_len + 1])
        pad_mask = [1] * len(toks)
        if len(toks) < seq_len + 1:
            k = seq_len + 1 - len(toks)
            pad_mask += [0] * k
            toks += [pad] * k
        pad_mask = np.array(pad_mask[1:])
        if stride != seq_len and idx != 0:
            pad_mask[:-stride] *= 0
        out.append((np.array(toks), pad_mask))
    return out


@pytest.mark.parametrize("n,L,s", [(2, 4, 1), (10, 4, 2), (37, 8, 3), (64, 16, 16), (100, 16, 5), (17, 32, 32), (50, 7, 7)])
def test_windows_match_megatron(n, L, s):
    tokens = np.arange(1000, 1000 + n)
    plan = WindowPlan(tokens, L, s, pad_id=0)
    ref = _megatron_lm_dataset(tokens, L, 0, s)
    assert plan.num_windows_megatron == len(ref)
    scored_ref = sorted((int(t[j + 1]), int(i)) for i, (t, m) in enumerate(ref) for j in np.nonzero(m)[0])
    scored = []
    for i in range(plan.num_windows):
        inp, lab, mask = plan.window(i)
        np.testing.assert_array_equal(np.concatenate([inp, lab[-1:]]), ref[i][0])
        np.testing.assert_array_equal(mask, ref[i][1])
        scored += [(int(lab[j]), i) for j in np.nonzero(mask)[0]]
    assert sorted(scored) == scored_ref  # same targets scored in the same windows
    assert [t for t, _ in sorted(scored)] == list(range(1001, 1000 + n))  # each target exactly once
    # Megatron's extra windows score nothing
    assert all(m.sum() == 0 for _, m in ref[plan.num_windows :])


def test_bad_window_options():
    with pytest.raises(EvalError, match="stride"):
        WindowPlan(np.arange(10), 4, 5, 0)
    with pytest.raises(EvalError, match="at least 2 tokens"):
        WindowPlan(np.arange(1), 4, 2, 0)


# ------------------------------------------------------------------------------------------------
# perplexity vs brute force with a real (tiny, random) GPT-2
# ------------------------------------------------------------------------------------------------
def tiny_gpt(vocab=300, padded=384, positions=64, seed=3):
    from training.models.config import ModelConfig
    from training.models.gpt2 import GPTModel

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=positions, vocab_size=vocab,
                      hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3)
    return GPTModel(cfg, padded, seed=seed).eval()


@pytest.mark.parametrize("L,s,bs", [(16, 4, 3), (16, 16, 2), (12, 5, 1)])
def test_stream_nll_equals_brute_force(L, s, bs):
    torch.manual_seed(0)
    model = tiny_gpt()
    tokens = torch.randint(0, 300, (103,)).numpy()
    scorer = LMScorer(model, vocab_size=300, max_length=64)
    res = score_stream(scorer, WindowPlan(tokens, L, s, pad_id=299), batch_size=bs, progress=False)
    # brute force: target j is predicted from the tokens of the window that scores it, one at a time
    total, n = 0.0, 0
    with torch.no_grad():
        for j in range(1, len(tokens)):
            start = 0 if j <= L else ((j - L - 1) // s + 1) * s
            assert j - start <= L and (start == 0 or j - start >= L - s + 1)
            ctx = torch.as_tensor(tokens[start:j]).unsqueeze(0)
            logp = torch.log_softmax(model(ctx)[0, -1, :300].double(), -1)
            total -= float(logp[tokens[j]])
            n += 1
    assert res.scored_tokens == n == len(tokens) - 1
    assert res.total_nll == pytest.approx(total, rel=1e-5)


def test_padding_columns_included_on_request():
    torch.manual_seed(1)
    model = tiny_gpt()
    tokens = torch.randint(0, 300, (40,)).numpy()
    plan = WindowPlan(tokens, 40, 40, 0)
    real = score_stream(LMScorer(model, 300, 64), plan, progress=False).total_nll
    padded = score_stream(LMScorer(model, 384, 64), plan, progress=False).total_nll
    with torch.no_grad():
        logits = model(torch.as_tensor(tokens[:-1]).unsqueeze(0))[0].double()
    lab = torch.as_tensor(tokens[1:])
    ce = lambda z: float(torch.nn.functional.cross_entropy(z, lab, reduction="sum"))  # noqa: E731
    assert real == pytest.approx(ce(logits[:, :300]), rel=1e-6)
    assert padded == pytest.approx(ce(logits), rel=1e-6)
    assert padded > real


class _CharTokenizer:
    """A real (if trivial) tokenizer: one id per byte, eod = 256 (for the full pipeline on real text)."""

    vocab_size = 257
    eod = 256

    def encode(self, text):
        return list(text.encode("utf-8"))


def test_wikitext_eval_end_to_end_numbers():
    raw = read_tokens_file(_need(WT103 / "wiki.test.tokens"))
    text = raw[:3000]
    model = tiny_gpt(vocab=257, padded=384)
    tok = _CharTokenizer()
    res = wikitext_eval(LMScorer(model, 257, 64), tok, text, seq_len=32, stride=8, batch_size=16, progress=False)
    ids = tok.encode(wikitext_detokenizer(text))
    assert res["num_tokenized_tokens"] == len(ids)
    assert res["num_original_tokens"] == len(text.strip().split(" "))
    assert res["scored_targets"] == len(ids) - 1
    assert res["loss"] == pytest.approx(res["total_nll"] / (len(ids) - 1))
    assert res["adjusted_ppl"] == pytest.approx(math.exp(min(20.0, res["total_nll"] / (res["num_original_tokens"] - 1))))
    assert res["adjusted_ppl"] == pytest.approx(math.exp(20.0))  # ~5 bytes per word: e^20 cap reached
    assert res["ppl"] == pytest.approx(math.exp(res["loss"]))


def test_bad_wikitext_files(tmp_path):
    with pytest.raises(EvalError, match="does not exist"):
        read_tokens_file(tmp_path / "nope.tokens")
    (tmp_path / "empty.tokens").write_text("  \n")
    with pytest.raises(EvalError, match="empty"):
        read_tokens_file(tmp_path / "empty.tokens")
    (tmp_path / "x.tokens").write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(EvalError, match="UTF-8"):
        read_tokens_file(tmp_path / "x.tokens")
    (tmp_path / "l.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(EvalError, match="suffix"):
        read_tokens_file(tmp_path / "l.jsonl")
