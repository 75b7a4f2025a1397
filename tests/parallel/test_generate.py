"""evaluation.generate on an imported random GPT-2: greedy equals transformers' generate token for token,
the KV-cached forward equals the full forward, top-k/top-p sampling stays in its set and is reproducible
per seed, TP=2 generates exactly what TP=1 does, and the CLI writes what the function returns."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_distributed

pytest.importorskip("transformers")
V = 50257
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived", "Hello"]


@pytest.fixture(scope="module")
def loaded(random_gpt2):
    from evaluation.generate import load_generator

    model, tok = load_generator(random_gpt2[1])
    return model, tok


def test_greedy_equals_transformers_generate(random_gpt2, loaded):
    from transformers import GPT2LMHeadModel

    from evaluation.generate import GenerationOptions, generate

    model, tok = loaded
    hf = GPT2LMHeadModel.from_pretrained(str(random_gpt2[0])).eval()
    # one batch of prompts of different lengths (left padding) against transformers, one prompt at a time
    ours = generate(model, tok, PROMPTS, GenerationOptions(max_new_tokens=16, greedy=True))
    for prompt, c in zip(PROMPTS, ours):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                              eos_token_id=tok.eod, pad_token_id=tok.eod)[0, ids.size(1):].tolist()
        if tok.eod in ref:
            ref = ref[:ref.index(tok.eod)]
        assert c.tokens == ref, prompt
        assert len(ref) == 16 and not c.stopped_at_eod
        assert c.text == tok.decode(ref)


def test_kv_cached_steps_equal_the_full_forward(loaded):
    from evaluation.generate import KVCache, forward_cached

    model, _ = loaded
    seq = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(seq)                                                   # [2, 30, V_padded]
        cache = KVCache(model, 2, 30, "cpu", torch.float32)
        valid = torch.ones(2, 30, dtype=torch.bool)
        steps = [forward_cached(model, seq[:, :10], torch.arange(10).expand(2, 10), valid, cache)]
        for t in range(10, 30):
            steps.append(forward_cached(model, seq[:, t:t + 1], torch.full((2, 1), t), valid, cache))
    torch.testing.assert_close(steps[0], full[:, 9], rtol=0, atol=1e-5)
    for i, t in enumerate(range(10, 30)):
        torch.testing.assert_close(steps[i + 1], full[:, t], rtol=0, atol=1e-5)



@pytest.mark.parametrize("extra", [dict(apply_query_key_layer_scaling=True), dict(attention_softmax_in_fp32=True),
                                   dict(position_embedding="rope", num_query_groups=2)],
                         ids=["qk-layer-scaling", "softmax-fp32", "rope-gqa"])
def test_model_forward_with_a_cache_equals_the_full_forward(extra):
    """The model's own forward with a KVCache, positions left to the cache (the tokens after the cached ones):
    Megatron's core attention over more keys than queries, and RoPE at the offset, as the full forward."""
    from training.models.config import ModelConfig
    from training.models.gpt2 import GPTModel
    from training.models.kv_cache import KVCache

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=24, vocab_size=100,
                      hidden_dropout=0.0, attention_dropout=0.0, **extra)
    model = GPTModel(cfg, 128, None, seed=5).eval()
    seq = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(seq)
        cache = KVCache(model, 2, 24, "cpu", torch.float32)
        steps = [model(seq[:, :8], cache=cache)] + [model(seq[:, t:t + 1], cache=cache) for t in range(8, 24)]
    assert cache.length == 24
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def _allowed(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> set[int]:
    """Independent reference of the sampling set: numpy, sorted once, no torch."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.ones(len(z), dtype=bool)
    if top_k:
        keep &= z >= z[order[top_k - 1]]
    p = np.exp(z - z[keep].max()) * keep
    p /= p.sum()
    kept, mass = set(), 0.0
    for i in order:
        if not keep[i] or mass >= top_p:
            continue
        kept.add(int(i))
        mass += p[i]
    return kept


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 40, 1.0), (0.7, 0, 0.9), (1.3, 200, 0.5), (1.0, 1, 1.0)])
def test_sampling_stays_in_the_top_k_top_p_set_and_is_reproducible(temperature, top_k, top_p):
    from evaluation.generate import GenerationOptions, choose_next, filter_logits

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 1000, generator=g) * 3
    opts = GenerationOptions(temperature=temperature, top_k=top_k, top_p=top_p)
    filtered = filter_logits(logits, temperature, top_k, top_p)
    draws = torch.stack([choose_next(logits, opts, gen) for gen in [torch.Generator().manual_seed(0)] for _ in range(100)])
    for row in range(4):
        allowed = _allowed(logits[row].numpy(), temperature, top_k, top_p)
        assert set(torch.isfinite(filtered[row]).nonzero().flatten().tolist()) == allowed
        assert set(draws[:, row].tolist()) <= allowed
        if top_k == 1:
            assert allowed == {int(logits[row].argmax())}
        elif len(allowed) > 5:
            assert len(set(draws[:, row].tolist())) > 1  # it does sample
    again = torch.stack([choose_next(logits, opts, gen) for gen in [torch.Generator().manual_seed(0)] for _ in range(100)])
    other = torch.stack([choose_next(logits, opts, gen) for gen in [torch.Generator().manual_seed(1)] for _ in range(100)])
    assert torch.equal(draws, again)
    if top_k != 1:
        assert not torch.equal(draws, other)


def test_sampled_generation_is_reproducible_per_seed_and_stops_at_eod(loaded):
    from evaluation.generate import GenerationOptions, generate

    model, tok = loaded
    opts = dict(max_new_tokens=8, temperature=0.9, top_k=50, top_p=0.95)
    a = generate(model, tok, PROMPTS, GenerationOptions(seed=5, **opts))
    b = generate(model, tok, PROMPTS, GenerationOptions(seed=5, **opts))
    c = generate(model, tok, PROMPTS, GenerationOptions(seed=6, **opts))
    assert [x.tokens for x in a] == [x.tokens for x in b] != [x.tokens for x in c]
    # stopping: with the first greedy token of prompt 0 declared the end-of-document id, row 0 stops at
    # once and every other row is its unstopped output cut before that id's first occurrence
    from evaluation.generate import generate_ids

    ids = [tok.encode(p) for p in PROMPTS]
    free = generate_ids(model, ids, GenerationOptions(max_new_tokens=10, greedy=True, stop_at_eod=False), None, V)
    eod = free[0][0][0]
    stopped = generate_ids(model, ids, GenerationOptions(max_new_tokens=10, greedy=True), eod, V)
    assert stopped[0] == ([], True)
    for (row, _), (cut, flag) in zip(free, stopped):
        assert flag == (eod in row) and cut == (row[:row.index(eod)] if eod in row else row)


def test_sampling_does_not_depend_on_the_vocabulary_padding(loaded):
    """The same weights saved with another vocabulary padding (TP = 2 pads 50,257 to 50,432, PP to 50,304) sample
    the same tokens for a seed: the choice is over the real vocabulary only, not over the padded width (padding
    rows here hold large random weights, so a leak would also show in greedy decoding)."""
    import copy

    from evaluation.generate import GenerationOptions, generate_ids

    model, tok = loaded
    wider = copy.deepcopy(model)
    w = model.embedding.word_embeddings.weight
    extra = torch.randn(128, w.size(1), generator=torch.Generator().manual_seed(0), dtype=w.dtype) * 5
    wider.embedding.word_embeddings.weight = torch.nn.Parameter(torch.cat([w.detach(), extra.to(w.device)]))
    ids = [tok.encode(p) for p in PROMPTS]
    for opts in (GenerationOptions(max_new_tokens=8, temperature=0.9, top_k=0, top_p=1.0, seed=3),
                 GenerationOptions(max_new_tokens=8, temperature=1.0, top_k=50, top_p=0.95, seed=4),
                 GenerationOptions(max_new_tokens=8, greedy=True)):
        assert generate_ids(model, ids, opts, None, V) == generate_ids(wider, ids, opts, None, V)


def _tp2_generate(rank, world, run_dir, prompts, sample_opts):
    import torch.distributed as dist

    from evaluation.generate import GenerationOptions, generate, load_generator
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=2)
    model, tok = load_generator(run_dir, group=ps.tp_group)
    greedy = generate(model, tok, prompts, GenerationOptions(max_new_tokens=8, greedy=True))
    sampled = generate(model, tok, prompts, GenerationOptions(max_new_tokens=8, **sample_opts))
    x = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.full_logits(x)[..., :V]
    dist.barrier()
    # the command under the launcher, last: it tears the process groups down on its way out (a process that
    # leaves them alive can abort at interpreter exit after its output was written)
    from evaluation.cli import main

    out = Path(run_dir).parent / "tp2_generate.json"
    code = main(["generate", "--tp", "2", "--checkpoint", run_dir, "--prompt", prompts[0], "--greedy",
                 "--max-new-tokens", "8", "--json", str(out), "--no-progress"])
    return [c.tokens for c in greedy], [c.tokens for c in sampled], logits, (code, dist.is_initialized(), str(out))


def test_tp2_generation_equals_tp1(random_gpt2, loaded):
    from transformers import GPT2LMHeadModel

    from evaluation.generate import GenerationOptions, generate

    model, tok = loaded
    sample_opts = dict(temperature=0.8, top_k=100, top_p=0.9, seed=11)
    greedy1 = [c.tokens for c in generate(model, tok, PROMPTS, GenerationOptions(max_new_tokens=8, greedy=True))]
    sampled1 = [c.tokens for c in generate(model, tok, PROMPTS, GenerationOptions(max_new_tokens=8, **sample_opts))]
    results = run_distributed(_tp2_generate, 2, str(random_gpt2[1]), PROMPTS, sample_opts)
    for greedy2, sampled2, _, (code, still_initialized, out) in results:
        assert greedy2 == greedy1
        assert sampled2 == sampled1
        assert code == 0 and not still_initialized
    assert json.loads(Path(out).read_text())["completions"][0]["tokens"] == greedy1[0]
    # TP=2 forward of the import equals transformers' logits
    hf = GPT2LMHeadModel.from_pretrained(str(random_gpt2[0])).eval()
    x = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(x).logits
    torch.testing.assert_close(results[0][2], ref, rtol=0, atol=1e-5)


def test_generate_cli_writes_what_the_function_returns(random_gpt2, loaded, tmp_path, capsys):
    from evaluation.cli import main
    from evaluation.generate import GenerationOptions, generate

    model, tok = loaded
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:2]) + "\n", encoding="utf-8")
    out = tmp_path / "gen.json"
    assert main(["generate", "--checkpoint", str(random_gpt2[1]), "--prompts", str(prompts), "--top-k", "20",
                 "--seed", "3", "--max-new-tokens", "6", "--json", str(out), "--no-progress"]) == 0
    res = json.loads(out.read_text())
    ref = generate(model, tok, PROMPTS[:2], GenerationOptions(max_new_tokens=6, top_k=20, seed=3))
    assert [c["tokens"] for c in res["completions"]] == [c.tokens for c in ref]
    assert res["completions"][0]["text"] in capsys.readouterr().out
    # the deepspeed launcher's argument order (--local_rank before the subcommand) parses
    from evaluation.cli import build_parser

    args = build_parser().parse_args(["--local_rank=1", "generate", "--tp", "2", "--checkpoint", "r", "--prompt", "x"])
    assert (args.task, args.tp, args.prompt) == ("generate", 2, ["x"])
    # bad options fail before the model is loaded, with one line
    assert main(["generate", "--checkpoint", str(random_gpt2[1]), "--prompt", "x", "--top-p", "0", "--no-progress"]) == 2
    assert main(["generate", "--checkpoint", str(random_gpt2[1]), "--prompt", "x", "--max-new-tokens", "100", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "error: top_p must be in (0, 1], got 0.0"
    assert err[1].startswith("error: a prompt of 1 tokens + max_new_tokens 100 exceeds the model's 64 positions")
