"""Tensor-parallel primitives on 2 and 4 gloo ranks against serial PyTorch references."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.distributed import run_distributed


def _seeded(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def _check_mappings(rank, world):
    import torch.distributed as dist

    from training.parallel import mappings as M

    g = dist.group.WORLD
    out = {}
    # f: identity forward, all-reduce backward
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    y = M.copy_to_parallel_region(x, g)
    (y * (rank + 1)).sum().backward()
    out["f_fwd"], out["f_grad"] = y.detach().tolist(), x.grad.tolist()
    # g: all-reduce forward, identity backward
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    y = M.reduce_from_parallel_region(x, g)
    (y * (rank + 1)).sum().backward()
    out["g_fwd"], out["g_grad"] = y.detach().tolist(), x.grad.tolist()
    # scatter / gather on the last dim
    full = torch.arange(2 * 4 * world, dtype=torch.float64).view(2, 4 * world).requires_grad_()
    part = M.scatter_to_parallel_region(full, g)
    (part * 2).sum().backward()
    out["scatter"], out["scatter_grad"] = part.detach().tolist(), full.grad.tolist()
    local = torch.full((2, 3), float(rank), requires_grad=True)
    gathered = M.gather_from_parallel_region(local, g)
    (gathered * torch.arange(3 * world, dtype=torch.float32)).sum().backward()
    out["gather"], out["gather_grad"] = gathered.detach().tolist(), local.grad.tolist()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_mappings_forward_backward(world):
    res = run_distributed(_check_mappings, world)
    total = sum(range(1, world + 1))
    for r, o in enumerate(res):
        assert o["f_fwd"] == [r + 1.0] * 3
        assert o["f_grad"] == [float(total)] * 3  # sum over ranks of d(y*(k+1))/dy
        assert o["g_fwd"] == [float(total)] * 3
        assert o["g_grad"] == [r + 1.0] * 3
        full = torch.arange(2 * 4 * world, dtype=torch.float64).view(2, 4 * world)
        assert o["scatter"] == full[:, 4 * r:4 * (r + 1)].tolist()
        # backward of scatter all-gathers every rank's grad chunk: each element gets 2 exactly once
        assert o["scatter_grad"] == torch.full_like(full, 2.0).tolist()
        assert o["gather"] == torch.cat([torch.full((2, 3), float(k)) for k in range(world)], -1).tolist()
        assert o["gather_grad"] == torch.arange(3 * r, 3 * r + 3, dtype=torch.float32).expand(2, 3).tolist()


def _check_layers(rank, world):
    import torch.distributed as dist

    from training.parallel.cross_entropy import vocab_parallel_cross_entropy
    from training.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    torch.set_default_dtype(torch.float64)
    g = dist.group.WORLD
    out = {}
    b, s, hin, hout = 3, 5, 8, 4 * world * 2
    x = _seeded((b, s, hin), 1)
    init_a = lambda w: w.copy_(_seeded(w.shape, 2))  # noqa: E731
    init_b = lambda w: w.copy_(_seeded(w.shape, 3))  # noqa: E731

    # Column (gathered and not) then Row: serial reference is two nn.functional.linear calls.
    col = ColumnParallelLinear(hin, hout, g, init_method=init_a)
    with torch.no_grad():
        col.bias.copy_(_seeded((hout,), 4).chunk(world)[rank])
    row = RowParallelLinear(hout, hin, g, init_method=init_b)
    with torch.no_grad():
        row.bias.copy_(_seeded((hin,), 5))
    xi = x.clone().requires_grad_()
    y = row(torch.relu(col(xi)))
    y.pow(2).sum().backward()
    out["mlp_y"], out["mlp_dx"] = y.detach(), xi.grad
    out["col_w_grad"], out["col_b_grad"] = col.weight.grad, col.bias.grad
    out["row_w_grad"], out["row_b_grad"] = row.weight.grad, row.bias.grad
    out["tags"] = (col.weight.tensor_model_parallel, col.weight.partition_dim, row.weight.partition_dim,
                   hasattr(row.bias, "tensor_model_parallel"))
    colg = ColumnParallelLinear(hin, hout, g, init_method=init_a, gather_output=True)
    xg = x.clone().requires_grad_()
    yg = colg(xg)
    (yg * _seeded(yg.shape, 6)).sum().backward()
    out["colg_y"], out["colg_dx"] = yg.detach(), xg.grad
    rown = RowParallelLinear(hout, hin, g, init_method=init_b, input_is_parallel=False)
    xr = _seeded((b, s, hout), 7).requires_grad_()
    yr = rown(xr)
    (yr * _seeded(yr.shape, 8)).sum().backward()
    out["rown_y"], out["rown_dx"] = yr.detach(), xr.grad

    # Vocab-parallel embedding with ids on every shard border
    vocab, dim = 8 * world, 6
    emb = VocabParallelEmbedding(vocab, dim, g, init_method=lambda w: w.copy_(_seeded(w.shape, 9)))
    per = vocab // world
    ids = torch.tensor([[k * per - 1 for k in range(1, world + 1)] + [k * per for k in range(world)] + [0, vocab - 1]])
    e = emb(ids)
    (e * _seeded(e.shape, 10)).sum().backward()
    out["emb"], out["emb_grad"], out["ids"] = e.detach(), emb.weight.grad, ids

    # Vocab-parallel cross-entropy, logits x 1000, targets on shard borders
    V = 11 * world
    logits_full = _seeded((4, 7, V), 11) * 1000
    targets = torch.tensor([k * 11 for k in range(world)] + [k * 11 - 1 for k in range(1, world + 1)])
    targets = torch.cat([targets, torch.randint(0, V, (28 - targets.numel(),), generator=torch.Generator().manual_seed(12))])
    targets = targets[:28].view(4, 7)
    local = logits_full.chunk(world, -1)[rank].clone().requires_grad_()
    before = local.detach().clone()
    loss = vocab_parallel_cross_entropy(local, targets, g)
    (loss * _seeded(loss.shape, 13)).sum().backward()
    out["ce_loss"], out["ce_grad"] = loss.detach(), local.grad
    out["ce_input_unchanged"] = torch.equal(local.detach(), before)
    out["ce_targets"], out["ce_logits"] = targets, logits_full
    # fp32 input is not modified either (the reference mutates fp32 logits in place)
    l32 = local.detach().float().clone()
    keep = l32.clone()
    vocab_parallel_cross_entropy(l32, targets, g)
    out["ce_fp32_unchanged"] = torch.equal(l32, keep)
    # inplace=True (GPTModel's use): logits produced by an autograd op, overwritten by the loss;
    # same loss and same gradient reaching the op's input
    src = before.clone().requires_grad_()
    produced = src * 1.0                                                    # non-leaf, like a linear's output
    loss_ip = vocab_parallel_cross_entropy(produced, targets, g, inplace=True)
    (loss_ip * _seeded(loss_ip.shape, 13)).sum().backward()
    out["ce_inplace_loss"], out["ce_inplace_grad"] = loss_ip.detach(), src.grad
    out["ce_inplace_overwrote"] = not torch.equal(produced.detach(), before)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layers_match_serial(world):
    res = run_distributed(_check_layers, world)
    torch.set_default_dtype(torch.float64)
    try:
        b, s, hin, hout = 3, 5, 8, 4 * world * 2
        x = _seeded((b, s, hin), 1).requires_grad_()
        A, Bw = _seeded((hout, hin), 2).requires_grad_(), _seeded((hin, hout), 3).requires_grad_()
        ba, bb = _seeded((hout,), 4).requires_grad_(), _seeded((hin,), 5).requires_grad_()
        y = F.linear(torch.relu(F.linear(x, A, ba)), Bw, bb)
        y.pow(2).sum().backward()
        xg = _seeded((b, s, hin), 1).requires_grad_()
        yg = F.linear(xg, A.detach())
        (yg * _seeded(yg.shape, 6)).sum().backward()
        xr = _seeded((b, s, hout), 7).requires_grad_()
        yr = F.linear(xr, Bw.detach())
        (yr * _seeded(yr.shape, 8)).sum().backward()
        vocab, dim = 8 * world, 6
        E = _seeded((vocab, dim), 9).requires_grad_()
        ids = res[0]["ids"]
        e = F.embedding(ids, E)
        (e * _seeded(e.shape, 10)).sum().backward()
        logits = res[0]["ce_logits"].clone().requires_grad_()
        targets = res[0]["ce_targets"]
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="none").view(targets.shape)
        (loss * _seeded(loss.shape, 13)).sum().backward()
    finally:
        torch.set_default_dtype(torch.float32)

    for r, o in enumerate(res):
        tol = dict(rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(o["mlp_y"], y.detach(), **tol)
        torch.testing.assert_close(o["mlp_dx"], x.grad, **tol)
        torch.testing.assert_close(o["col_w_grad"], A.grad.chunk(world, 0)[r], **tol)
        torch.testing.assert_close(o["col_b_grad"], ba.grad.chunk(world, 0)[r], **tol)
        torch.testing.assert_close(o["row_w_grad"], Bw.grad.chunk(world, 1)[r], **tol)
        torch.testing.assert_close(o["row_b_grad"], bb.grad, **tol)  # replicated bias: full grad everywhere
        assert o["tags"] == (True, 0, 1, False)
        torch.testing.assert_close(o["colg_y"], yg.detach(), **tol)
        torch.testing.assert_close(o["colg_dx"], xg.grad, **tol)
        torch.testing.assert_close(o["rown_y"], yr.detach(), **tol)
        torch.testing.assert_close(o["rown_dx"], xr.grad, **tol)
        torch.testing.assert_close(o["emb"], e.detach(), **tol)
        torch.testing.assert_close(o["emb_grad"], E.grad.chunk(world, 0)[r], **tol)
        torch.testing.assert_close(o["ce_loss"], loss.detach(), rtol=1e-9, atol=1e-6)
        torch.testing.assert_close(o["ce_grad"], logits.grad.chunk(world, -1)[r], rtol=1e-9, atol=1e-9)
        assert o["ce_input_unchanged"] and o["ce_fp32_unchanged"]
        torch.testing.assert_close(o["ce_inplace_loss"], loss.detach(), rtol=1e-9, atol=1e-6)
        torch.testing.assert_close(o["ce_inplace_grad"], logits.grad.chunk(world, -1)[r], rtol=1e-9, atol=1e-9)
        assert o["ce_inplace_overwrote"]


def test_tp1_layers_equal_nn_modules():
    """TP=1 (no group) Column/Row/Embedding compute exactly nn.Linear / nn.Embedding."""
    from training.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    torch.manual_seed(0)
    col = ColumnParallelLinear(6, 10, None, init_method=torch.nn.init.normal_)
    row = RowParallelLinear(10, 6, None, init_method=torch.nn.init.normal_)
    emb = VocabParallelEmbedding(9, 4, None, init_method=torch.nn.init.normal_)
    x = torch.randn(2, 6)
    ref_col = torch.nn.Linear(6, 10)
    ref_col.load_state_dict(col.state_dict())
    ref_row = torch.nn.Linear(10, 6)
    ref_row.load_state_dict(row.state_dict())
    torch.testing.assert_close(row(col(x)), ref_row(ref_col(x)), rtol=0, atol=0)
    ids = torch.tensor([0, 8, 3])
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.weight), rtol=0, atol=0)
