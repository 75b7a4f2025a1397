"""LAMBADA: the real file (5,153 examples, strict target lengths), strict vs last-token on hand-built
cases where they differ, batched scoring vs one example at a time, bad input."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from evaluation.errors import EvalError
from evaluation.lambada import build_examples, read_lambada_jsonl, score_lambada, strict_split
from evaluation.scoring import LMScorer
from evaluation.tasks import lambada_eval

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
LAMBADA = DATA / "eval" / "lambada" / "lambada_test.jsonl"
GPT2 = DATA / "tokenizers" / "gpt2"


def _need(p: Path) -> Path:
    if not p.exists():
        pytest.skip(f"shared data {p} is absent")
    return p


@pytest.fixture(scope="module")
def tok():
    from megatron_ds_suite.core.tokenizer import GPT2BPETokenizer

    _need(GPT2)
    return GPT2BPETokenizer(GPT2 / "gpt2-vocab.json", GPT2 / "gpt2-merges.txt")


@pytest.fixture(scope="module")
def texts():
    return read_lambada_jsonl(_need(LAMBADA))


def test_real_file(texts, tok):
    assert len(texts) == 5_153
    ex = build_examples(texts, tok, strict=True)
    assert Counter(len(e.target) for e in ex) == {1: 4013, 2: 913, 3: 208, 4: 16, 5: 3}
    assert max(len(e.context) + len(e.target) for e in ex) == 224
    # the 7 examples whose last word follows a newline: strict still prepends a space
    nl = [t for t in texts if t[t.rfind(t.split()[-1]) - 1] != " "]
    assert len(nl) == 7
    c, w = strict_split(nl[0])
    assert w == " " + nl[0].split()[-1] and not c.endswith(("\n", " "))
    last = build_examples(texts, tok, strict=False)
    assert all(len(e.target) == 1 for e in last)


class SparseBigramLM(torch.nn.Module):
    """A real causal LM of order 2: logits(next | cur) = 5 on chosen (cur -> next) pairs, 0 elsewhere."""

    def __init__(self, rules: dict[int, int], vocab: int):
        super().__init__()
        self.rules, self.vocab = rules, vocab

    def forward(self, tokens):
        out = torch.zeros(*tokens.shape, self.vocab)
        for (b, s), t in zip(torch.cartesian_prod(torch.arange(tokens.size(0)), torch.arange(tokens.size(1))).tolist(),
                             tokens.flatten().tolist()):
            if t in self.rules:
                out[b, s, self.rules[t]] = 5.0
        return out


def test_strict_vs_last_token_differ(tok):
    v = tok.vocab_size
    # "I saw a flamingo": strict target [' flaming', 'o'] after ' a'; last-token target 'o' after ' flaming'
    assert tok.encode(" flamingo") == [39518, 78] and tok.encode("I saw a")[-1] == 257
    # "... said\nPennsylvania": strict target [' Pennsylvania'] after ' said'; last-token 'sylvania' after 'Penn'
    assert tok.encode(" Pennsylvania") == [9589] and tok.encode("\nPennsylvania") == [198, 39899, 9270]
    texts = ["I saw a flamingo", "the old man said\nPennsylvania"]
    model = SparseBigramLM({39518: 78, 531: 9589}, v)  # knows 'flaming'->'o' and ' said'->' Pennsylvania'
    scorer = LMScorer(model, v, max_length=64)
    strict = score_lambada(scorer, build_examples(texts, tok, True), tok.eod, progress=False)
    last = score_lambada(scorer, build_examples(texts, tok, False), tok.eod, progress=False)
    assert strict.correct.tolist() == [0, 1]
    assert last.correct.tolist() == [1, 0]
    # log-probabilities: a rule puts 5 on its entry and 0 on the other v-1; no rule = uniform
    hit = 5.0 - math.log(math.exp(5.0) + v - 1)
    miss = -math.log(v)
    assert strict.target_logprob.tolist() == pytest.approx([miss + hit, hit])
    assert strict.target_tokens.tolist() == [2, 1]
    assert last.target_logprob.tolist() == pytest.approx([hit, miss])
    # the metric module: per-example word perplexity exp(-mean Σlogp)
    res = lambada_eval(scorer, tok, texts, strict=True, progress=False)
    assert res["accuracy"] == 0.5 and res["count"] == 2
    assert res["perplexity"] == pytest.approx(math.exp(-(miss + 2 * hit) / 2))
    assert res["token_perplexity"] == pytest.approx(math.exp(-(miss + 2 * hit) / 3))


def test_batched_equals_one_at_a_time(texts, tok):
    from training.models.config import ModelConfig
    from training.models.gpt2 import GPTModel

    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=256, vocab_size=tok.vocab_size,
                      hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.5)
    model = GPTModel(cfg, 50304, seed=5).eval()
    sub = texts[:24]
    ex = build_examples(sub, tok, strict=True)
    scorer = LMScorer(model, tok.vocab_size, max_length=256)
    batched = score_lambada(scorer, ex, tok.eod, batch_size=7, progress=False)
    for i, e in enumerate(ex):
        seq = torch.tensor(e.context + e.target)
        with torch.no_grad():
            logits = model(seq[None, :-1])[0, :, : tok.vocab_size].double()
        pos = range(len(e.context) - 1, len(seq) - 1)
        greedy = all(int(logits[p].argmax()) == int(seq[p + 1]) for p in pos)
        lp = sum(float(torch.log_softmax(logits[p], -1)[seq[p + 1]]) for p in pos)
        assert batched.correct[i] == int(greedy)
        assert batched.target_logprob[i] == pytest.approx(lp, rel=1e-5, abs=1e-4)


def test_bad_jsonl(tmp_path):
    p = tmp_path / "l.jsonl"
    p.write_text('{"text": "a b"}\n{"text": "c d"\n')
    with pytest.raises(EvalError, match=r"l\.jsonl:2: malformed JSON"):
        read_lambada_jsonl(p)
    p.write_text('{"text": "a b"}\n{"txt": "c d"}\n')
    with pytest.raises(EvalError, match=r":2: missing key 'text'"):
        read_lambada_jsonl(p)
    p.write_text("")
    with pytest.raises(EvalError, match="empty"):
        read_lambada_jsonl(p)
    p.write_text('{"text": "a b"}\n\n{"text": "c"}\n')
    with pytest.raises(EvalError, match=":2: empty line"):
        read_lambada_jsonl(p)
    with pytest.raises(EvalError, match="does not exist"):
        read_lambada_jsonl(tmp_path / "missing.jsonl")
