"""BERT model: TP=2 equals TP=1 (MLM, SOP, gradients, multiple-choice logits), layer order, padding, heads."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.distributed import run_distributed
from training.models.config import ModelConfig

PADDED_VOCAB = 256  # same padded vocabulary at TP=1 and TP=2 (128 x 2), so weights agree exactly
VOCAB = 200


def _cfg(order="pre_ln", layers=2, dropout=0.0):
    return ModelConfig(arch="bert", num_layers=layers, hidden_size=64, num_attention_heads=4, seq_length=24,
                       vocab_size=VOCAB, hidden_dropout=dropout, attention_dropout=dropout, layer_order=order)


def _batch(b=3, s=24):
    """Random ids with right padding, two segments, ~15 % of real positions predicted, SOP labels."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(5, VOCAB, (b, s), generator=g)
    lengths = torch.tensor([s, s - 7, s - 12])[:b]
    padding = (torch.arange(s)[None, :] < lengths[:, None]).long()
    types = ((torch.arange(s)[None, :] >= (lengths // 2)[:, None]) & padding.bool()).long()
    loss_mask = ((torch.rand(b, s, generator=g) < 0.15) & padding.bool()).long()
    loss_mask[:, 1] = 1
    labels = torch.where(loss_mask.bool(), torch.randint(5, VOCAB, (b, s), generator=g), torch.full_like(tokens, -1))
    tokens = tokens.masked_fill(padding == 0, 0)
    sop = torch.tensor([0, 1, 1])[:b]
    return tokens, types, padding, labels, loss_mask, sop


def _run(model, batch):
    from training.models.bert import bert_loss

    tokens, types, padding, labels, loss_mask, sop = batch
    lm, sop_logits = model(tokens, types, padding, labels, loss_mask)
    loss, parts = bert_loss(lm, sop_logits, sop)
    parts = {k: float(v) for k, v in parts.items()}
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return parts, grads


def _mc_inputs():
    g = torch.Generator().manual_seed(5)
    text = torch.randint(5, VOCAB, (2, 4, 24), generator=g)
    types = torch.zeros_like(text)
    types[..., 10:] = 1
    padding = torch.ones_like(text)
    padding[1, :, 20:] = 0
    return text, types, padding


def _tp_worker(rank, world, orders):
    from training.models.bert import BertModel, BertMultipleChoice
    from training.parallel import random as tp_random
    from training.parallel.state import ParallelState

    ps = ParallelState(tp=world)
    tp_random.configure(ps, num_layers=2)
    tp_random.set_seed(1234)
    out = {}
    for order in orders:
        model = BertModel(_cfg(order), PADDED_VOCAB, ps.tp_group, seed=1234).eval()
        parts, grads = _run(model, _batch())
        mc = BertMultipleChoice(_cfg(order), PADDED_VOCAB, ps.tp_group, seed=1234).eval()
        with torch.no_grad():
            mc_logits = mc(*_mc_inputs())
        tags = {n: (getattr(p, "partition_dim", None), getattr(p, "partition_stride", None))
                for n, p in model.named_parameters()}
        out[order] = {"parts": parts, "grads": grads, "tags": tags, "mc": mc_logits}
    return out


def _merge(name, shards, tags):
    dim, stride = tags[name]
    if dim is None:
        return shards[0]
    pieces = [s.chunk(stride or 1, dim) for s in shards]
    return torch.cat([pieces[r][k] for k in range(stride or 1) for r in range(len(shards))], dim)


@pytest.fixture(scope="module")
def tp2_results():
    return run_distributed(_tp_worker, 2, ("pre_ln", "post_ln"))  # one spawn for both orders


@pytest.mark.parametrize("order", ["pre_ln", "post_ln"])
def test_bert_tp2_equals_tp1(order, tp2_results):
    from training.models.bert import BertModel, BertMultipleChoice

    ref = BertModel(_cfg(order), PADDED_VOCAB, None, seed=1234).eval()
    parts, grads = _run(ref, _batch())
    with torch.no_grad():
        ref_mc = BertMultipleChoice(_cfg(order), PADDED_VOCAB, None, seed=1234).eval()(*_mc_inputs())
    res = [r[order] for r in tp2_results]
    tags = res[0]["tags"]
    for r in res:
        assert r["parts"]["mlm_loss"] == pytest.approx(parts["mlm_loss"], rel=1e-5)
        assert r["parts"]["sop_loss"] == pytest.approx(parts["sop_loss"], rel=1e-5)
        torch.testing.assert_close(r["mc"], ref_mc, rtol=1e-4, atol=1e-5)
    assert parts["mlm_loss"] > 4.0 and parts["sop_loss"] > 0.1  # untrained: near log(V) and log(2)
    for name, g in grads.items():
        merged = _merge(name, [r["grads"][name] for r in res], tags)
        torch.testing.assert_close(merged, g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert tags["lm_head.bias"] == (0, 1) and tags["embedding.word_embeddings.weight"] == (0, 1)
    assert tags["layers.0.attn.qkv.weight"] == (0, 3) and tags["pooler.weight"] == (None, None)
    # replicated parameters get identical gradients on both ranks
    for name in ("binary_head.weight", "lm_head.dense.weight", "embedding.tokentype_embeddings.weight"):
        torch.testing.assert_close(res[0]["grads"][name], res[1]["grads"][name], rtol=0, atol=0)
    assert res[0]["grads"]["lm_head.bias"].shape == (PADDED_VOCAB // 2,)


def test_layer_order_switch_changes_the_order_of_operations():
    from training.models.bert import BertLayer

    torch.manual_seed(0)
    x = torch.randn(2, 24, 64)
    mask = torch.ones(2, 1, 1, 24, dtype=torch.bool)
    pre = BertLayer(_cfg("pre_ln"), None, 1234, 0).eval()
    post = BertLayer(_cfg("post_ln"), None, 1234, 0).eval()
    post.load_state_dict(pre.state_dict())  # identical weights, only the order differs
    with torch.no_grad():  # non-trivial LayerNorm parameters so that every LN placement matters
        for layer in (pre, post):
            for ln in (layer.ln1, layer.ln2):
                ln.weight.copy_(torch.linspace(0.5, 1.5, 64))
                ln.bias.copy_(torch.linspace(-0.2, 0.2, 64))
    attn, mlp, ln1, ln2 = pre.attn, pre.mlp, pre.ln1, pre.ln2
    with torch.no_grad():
        r = x + attn(ln1(x), mask)
        want_pre = r + mlp(ln2(r))                # Figure 7 (b): LayerNorm before each sublayer
        r = ln1(x + attn(x, mask))
        want_post = ln2(r + mlp(r))               # Figure 7 (a): original BERT, LayerNorm after the residual
        got_pre, got_post = pre(x, mask), post(x, mask)
    torch.testing.assert_close(got_pre, want_pre, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_post, want_post, rtol=1e-6, atol=1e-6)
    assert (got_pre - got_post).abs().max() > 0.1
    # post-LN output is normalised (then scaled by ln2); pre-LN output is not
    norm = (got_post - ln2.bias) / ln2.weight
    torch.testing.assert_close(norm.mean(-1), torch.zeros(2, 24), atol=1e-5, rtol=0)


def test_padding_is_invisible_and_attention_is_bidirectional():
    from training.models.bert import BertModel

    model = BertModel(_cfg(), PADDED_VOCAB, None, seed=3).eval()
    tokens, types, padding, *_ = _batch()
    with torch.no_grad():
        h = model.encode(tokens, types, padding)
        changed = tokens.clone()
        changed[padding == 0] = 77                      # different ids on padding positions
        h2 = model.encode(changed, types, padding)
        late = tokens.clone()
        late[0, -1] = (late[0, -1] + 1) % VOCAB + 5     # change the LAST real token of row 0
        h3 = model.encode(late, types, padding)
    real = padding.bool()
    torch.testing.assert_close(h[real], h2[real], rtol=0, atol=1e-6)
    assert (h3[0, 0] - h[0, 0]).abs().max() > 1e-4      # position 0 sees the future: not causal


def test_multiple_choice_head_gives_four_logits_per_question():
    from training.models.bert import BertMultipleChoice

    mc = BertMultipleChoice(_cfg(), PADDED_VOCAB, None, seed=3).eval()
    text, types, padding = _mc_inputs()
    with torch.no_grad():
        logits = mc(text, types, padding)
        perm = torch.tensor([2, 0, 3, 1])
        permuted = mc(text[:, perm], types[:, perm], padding[:, perm])
    assert logits.shape == (2, 4)
    torch.testing.assert_close(permuted, logits[:, perm], rtol=1e-5, atol=1e-6)  # one logit per option
    assert logits.std() > 0
    loss = F.cross_entropy(mc.train()(text, types, padding), torch.tensor([1, 3]))
    loss.backward()
    assert mc.choice_head.weight.grad.abs().sum() > 0 and mc.bert.layers[0].attn.qkv.weight.grad.abs().sum() > 0
