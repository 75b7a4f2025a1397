"""Context parallelism without processes (issue 43 item 1): the ring's load-balanced chunk assignment, the online
softmax's block combination against whole attention (one ring step at a time, every rank's view, grouped-query
attention included), the CP process layout, and the one-line config refusals."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from training.data.documents import document_attention_mask
from training.parallel.ring_attention import (
    block_attention,
    block_grads,
    block_mask,
    fold_block,
    merge,
    pairs,
    ring_chunks,
    ring_positions,
)
from training.parallel.state import ParallelDims

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_chunks_cover_the_sequence_and_balance_the_causal_work(cp):
    s = 8 * cp
    held = [ring_positions(s, r, cp) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(s))  # every token once
    length = s // (2 * cp)
    for r, pos in enumerate(held):
        a, b = ring_chunks(r, cp)
        assert (a, b) == (r, 2 * cp - 1 - r)
        assert torch.equal(pos, torch.cat([torch.arange(a * length, (a + 1) * length),
                                           torch.arange(b * length, (b + 1) * length)]))
    # causal (query, key) pairs per rank: sum over its positions of (position + 1), the same on every rank
    work = {int((pos + 1).sum()) for pos in held}
    assert len(work) == 1, work


def test_merged_blocks_equal_one_softmax_over_all_keys():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = torch.cat([k, 3 * k]), torch.cat([v, v])                      # scores of different sizes per block
    q = torch.cat([q, q])
    full = F.scaled_dot_product_attention(q, k, v)
    out = lse = None
    for sl in (slice(0, 2), slice(2, 3), slice(3, 5)):                  # three disjoint key blocks
        out, lse = merge(out, lse, *block_attention(q, k[:, :, sl], v[:, :, sl], causal=False))
    assert torch.allclose(out, full, atol=1e-12)
    scale = q.size(-1) ** -0.5
    assert torch.allclose(lse, torch.logsumexp(q @ k.transpose(-1, -2) * scale, dim=-1), atol=1e-12)
    # the causal diagonal block: one chunk against itself is causal attention
    assert torch.allclose(block_attention(q, k, v, causal=True)[0], F.scaled_dot_product_attention(q, k, v, is_causal=True),
                          atol=1e-12)


def _packed(s: int) -> torch.Tensor:
    """[2, s] token ids with EODs (0) at 1 and s/2 (row 0) and at 2 and s - 3 (row 1): documents ending inside
    ring chunks, whole chunks that see none of another chunk's keys."""
    tokens = torch.ones(2, s, dtype=torch.long)
    tokens[0, [1, s // 2]] = 0
    tokens[1, [2, s - 3]] = 0
    return tokens


@pytest.mark.parametrize("cp,documents", [(2, False), (3, False), (2, True), (3, True)])
def test_every_rank_folding_every_ring_step_equals_causal_attention(cp, documents):
    """What :func:`ring_attention` computes on each rank, its ring replaced by slicing: the rank's queries against
    every rank's keys and values in ring order, GQA (6 query heads, 2 key/value heads) -> the rank's rows of
    causal attention over the whole sequence; gradients too. ``documents``: under a packed-document mask (the
    rank's query rows, :func:`document_attention_mask`), against SDPA with the whole mask (outputs only: autograd
    through a block no query row of which sees a key is nan, which :class:`RingAttention`'s own backward avoids;
    its gradients are the next test's)."""
    g = torch.Generator().manual_seed(1)
    s, n, kv_heads = 4 * cp, 6, 2
    q = torch.randn(2, n, s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, s, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    tokens = _packed(s)
    full = F.scaled_dot_product_attention(q, k.repeat_interleave(n // kv_heads, 1),
                                          v.repeat_interleave(n // kv_heads, 1), is_causal=not documents,
                                          attn_mask=document_attention_mask(tokens, 0) if documents else None)
    up = torch.randn(full.shape, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad((full * up).sum(), (q, k, v))
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp):
        pos = ring_positions(s, rank, cp)
        results: list = [(None, None), (None, None)]
        for step in range(cp):
            src = (rank - step) % cp
            their = ring_positions(s, src, cp)
            fold_block(results, q[:, :, pos], ring_chunks(rank, cp), k[:, :, their], v[:, :, their],
                       ring_chunks(src, cp), document_attention_mask(tokens, 0, pos) if documents else None)
        out = torch.cat([o for o, _ in results], dim=2)
        assert torch.allclose(out, full[:, :, pos], atol=1e-12), rank
        if documents:
            continue
        for acc, gr in zip(grads, torch.autograd.grad((out * up[:, :, pos]).sum(), (q, k, v))):
            acc += gr
    for gr, ref in zip(grads, ref_grads):
        assert documents or torch.allclose(gr, ref, atol=1e-12)


@pytest.mark.parametrize("cp,documents", [(2, False), (3, False), (2, True), (3, True)])
def test_block_gradients_from_the_final_log_sum_exp_equal_autograd(cp, documents):
    """:class:`RingAttention`'s backward, its ring replaced by slicing: each rank's blocks' (dq, dk, dv) from
    :func:`block_grads` with the rank's final log-sum-exp, dk and dv summed over the GQA repeats and over the
    ranks whose queries saw them -> the gradients of causal attention over the whole sequence; ``documents``: under
    a packed-document mask (the rank's query rows, each block's part: :func:`block_mask`)."""
    g = torch.Generator().manual_seed(2)
    s, n, kv_heads, rep = 4 * cp, 6, 2, 3
    q = torch.randn(2, n, s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, s, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    tokens = _packed(s)
    full = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          is_causal=not documents,
                                          attn_mask=document_attention_mask(tokens, 0) if documents else None)
    up = torch.randn(full.shape, generator=g, dtype=torch.float64)
    ref = torch.autograd.grad((full * up).sum(), (q, k, v))
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    with torch.no_grad():
        for rank in range(cp):
            pos = ring_positions(s, rank, cp)
            mask = document_attention_mask(tokens, 0, pos) if documents else None
            results: list = [(None, None), (None, None)]
            for src in range(cp):
                their = ring_positions(s, src, cp)
                fold_block(results, q[:, :, pos], ring_chunks(rank, cp), k[:, :, their], v[:, :, their],
                           ring_chunks(src, cp), mask)
            out, lse = (torch.cat([r[i] for r in results], dim=2) for i in range(2))
            dout = up[:, :, pos]
            delta = (dout * out).sum(-1)
            for src in range(cp):
                their = ring_positions(s, src, cp)
                kr, vr = (t[:, :, their].repeat_interleave(rep, 1) for t in (k, v))
                for a, b, causal in pairs(ring_chunks(rank, cp), ring_chunks(src, cp)):
                    qa_pos, kb_pos = pos.chunk(2)[a], their.chunk(2)[b]
                    ch = slice(a * len(qa_pos), (a + 1) * len(qa_pos))
                    kc = slice(b * len(kb_pos), (b + 1) * len(kb_pos))
                    keep = block_mask(mask, a, ring_chunks(src, cp)[b], len(qa_pos))
                    gq, gk, gv = block_grads(q[:, :, qa_pos], kr[:, :, kc], vr[:, :, kc], dout[:, :, ch],
                                             lse[:, :, ch], delta[:, :, ch], causal, keep)
                    dq[:, :, qa_pos] += gq
                    dk[:, :, kb_pos] += gk.unflatten(1, (kv_heads, rep)).sum(2)
                    dv[:, :, kb_pos] += gv.unflatten(1, (kv_heads, rep)).sum(2)
    for mine, r in zip((dq, dk, dv), ref):
        assert torch.allclose(mine, r, atol=1e-12)


def test_context_parallel_ranks_sit_between_tensor_and_data_parallel():
    dims = ParallelDims(16, tp=2, pp=2, cp=2)
    assert dims.dp == 2
    # rank = pp * (dp cp tp) + dp * (cp tp) + cp * tp + tp
    for rank in range(16):
        pp, dp, tp = dims.coords(rank)
        assert rank == pp * 8 + dp * 4 + dims.cp_rank(rank) * 2 + tp
    assert ParallelDims(8, tp=2).coords(5) == (0, 2, 1)                   # CP 1: the old layout
    from megatron_ds_suite.core.errors import ConfigError

    with pytest.raises(ConfigError, match="world size 6 is not divisible by TP x CP x PP = 2 x 2 x 1"):
        ParallelDims(6, tp=2, cp=2)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.context_impl=ring", "model.seq_length=18"], "model.seq_length=18 is not divisible by 4"),
    (["model.seq_length=63"], "model.seq_length=63 is not divisible by 2"),
    (["parallel.context=4"], "does not divide the 6 attention heads per TP rank"),
    (["parallel.tensor=2"], "does not divide the 3 attention heads per TP rank"),
    (["parallel.pipeline=3"], "parallel.context=2 with parallel.pipeline=3"),
    (["parallel.context_impl=ring", "model.attention_dropout=0.1"], "model.attention_dropout=0.1 (ring)"),
    (["parallel.context=0"], "parallel.context must be >= 1"),
    (["model.sliding_window=8"], "parallel.context=2 with model.sliding_window=8"),
    (["parallel.tensor=2", "parallel.sequence_parallel=true", "model.num_attention_heads=8", "model.seq_length=18"],
     "model.seq_length=18 / parallel.context=2 is not a multiple of parallel.tensor=2"),
])
def test_config_refusals_are_one_line(overrides, message):
    from megatron_ds_suite.core.errors import ConfigError
    from training.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "llama_tiny.yaml", ["parallel.tensor=1", "parallel.context=2", *overrides])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_context_parallel_configs_load():
    from training.config import load_config

    documents = [f"data.{n}=true" for n in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")]
    for impl in ("ulysses", "ring"):  # selective recomputation too (the ring keeps no scores: nothing to recompute)
        cfg = load_config(ROOT / "configs" / "llama_tiny.yaml", ["parallel.tensor=1", "parallel.context=2",
                                                                 f"parallel.context_impl={impl}", "model.recompute=selective",
                                                                 *documents])  # packed documents too
        assert (cfg.parallel.context, cfg.parallel.context_impl) == (2, impl)


def test_context_parallel_ranks_share_their_samples_in_the_layout():
    from training.config import load_config
    from training.layout import derive_layout

    cfg = load_config(ROOT / "configs" / "llama_tiny.yaml", ["parallel.tensor=1", "parallel.context=2"])
    assert derive_layout(cfg, 4).dp == 2                                 # 4 ranks = CP 2 x DP 2
    assert derive_layout(cfg, 2).dp == 1
    from megatron_ds_suite.core.errors import ConfigError

    with pytest.raises(ConfigError, match="not divisible by TP x CP x PP = 1 x 2 x 1"):
        derive_layout(cfg, 3)


@pytest.mark.parametrize("cp", [2, 4])
def test_planner_divides_activations_by_c_and_shards_zero_over_dp_x_cp(cp):
    from training.layout import Layout
    from training.plan.memory import memory
    from training.plan.presets import preset_shape

    shape = preset_shape("gpt2-1.2b")
    base, lay = Layout(tp=2, dp=2, micro_batch=4, global_batch=8), Layout(tp=2, dp=2, micro_batch=4, global_batch=8,
                                                                         context=cp)
    assert lay.world_size == 4 * cp
    one, split = memory(shape, base), memory(shape, lay)
    for field in ("activations", "activations_ckpt", "activations_selective"):
        assert getattr(split, field) == pytest.approx(getattr(one, field) / cp, rel=1e-12), field
    assert (split.params, split.grads, split.optimizer) == (one.params, one.grads, one.optimizer)  # replicated over CP
    assert split.optimizer_zero1 == pytest.approx(one.optimizer_zero1 / cp, rel=1e-12)
