"""Megatron-LM's ``torch_dist`` format both ways (issue 44): a checkpoint Megatron-Core's own
``dist_checkpointing.save`` writes from TP=2 imports with Megatron's logits, and ``export_megatron --format
torch_dist`` writes files Megatron-Core's ``dist_checkpointing.load`` reads into a fresh TP=2 model that then gives
the same logits (fp32, 1e-5). GPT-2 (tied, learned positions, LayerNorm) and the Llama shape (RoPE, RMSNorm,
SwiGLU, grouped-query attention, untied, no biases), two gloo ranks, one launch; CPU shims as in
tests/helpers/megatron_core_models.py."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.megatron_core_models import (
    GPT2_DIR,
    LLAMA_ARGS,
    inputs,
    megatron_args,
    megatron_logits,
    megatron_model,
    noise,
)

ITERATION = 9
ARCHS = ("gpt2", "llama")


def _worker(rank: int, world: int, padded: int, vocab: int, root: str, tokens, types_, pad) -> dict:
    from megatron.core import dist_checkpointing, parallel_state

    from training.tools.export_megatron import export_megatron
    from training.tools.import_megatron import import_megatron

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.cuda.synchronize = lambda *a, **k: None  # the saver waits for device copies and reduces its failure flags
    torch.cuda.current_device = lambda: "cpu"     # on the "current device": on the CPU here
    out = {}
    for arch in ARCHS:
        torch.manual_seed(1234)
        model = megatron_model(arch, world, padded)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(noise(name, rank, getattr(p, "tensor_model_parallel", False), p.shape))
        ref, _ = megatron_logits(model, arch, world, tokens, types_, pad)
        state = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
        args = megatron_args([state] * world, arch, vocab, 1, ITERATION, **(LLAMA_ARGS if arch == "llama" else {}))
        save, run, back = (Path(root) / arch / d for d in ("megatron", "ours", "back"))
        if rank == 0:
            (save / f"iter_{ITERATION:07d}").mkdir(parents=True)
            (save / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        torch.distributed.barrier()
        # what Megatron-LM's save_checkpoint hands dist_checkpointing (--ckpt-format torch_dist, weights)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": ITERATION,
                                 "checkpoint_version": 3.0}, str(save / f"iter_{ITERATION:07d}"))
        torch.distributed.barrier()
        if rank == 0:
            import_megatron(save, run, 1, 1, vocab_file=str(GPT2_DIR / "gpt2-vocab.json"),
                            merge_file=str(GPT2_DIR / "gpt2-merges.txt"))
            export_megatron(run, back, tp=world, iteration=ITERATION, fmt="torch_dist")
        torch.distributed.barrier()
        torch.manual_seed(99)
        fresh = megatron_model(arch, world, padded)
        before, _ = megatron_logits(fresh, arch, world, tokens, types_, pad)
        with torch.serialization.safe_globals([argparse.Namespace]):  # as Megatron-LM's checkpointing allows it
            loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()}, str(back / f"iter_{ITERATION:07d}"))
        assert loaded["iteration"] == ITERATION and loaded["args"].tensor_model_parallel_size == world
        fresh.load_state_dict(loaded["model"])
        after, _ = megatron_logits(fresh, arch, world, tokens, types_, pad)
        out[arch] = (ref, before, after, str(run))
    return out


def test_torch_dist_checkpoints_import_and_export_with_megatrons_logits(tmp_path):
    pytest.importorskip("megatron.core", reason="the test extra's megatron-core (Megatron's own modules)")
    from megatron_ds_suite.core.tokenizer import load_tokenizer
    from training.checkpoint_reader import load_model_for_eval

    if not GPT2_DIR.is_dir():
        pytest.skip("../shared/data/tokenizers/gpt2 absent")
    vocab = load_tokenizer({"kind": "gpt2_bpe", "vocab_file": str(GPT2_DIR / "gpt2-vocab.json"),
                            "merges_file": str(GPT2_DIR / "gpt2-merges.txt")}).vocab_size
    padded = 64 * -(-vocab // 64)
    tokens, types_, pad = inputs(vocab)
    results = run_distributed(_worker, 2, padded, vocab, str(tmp_path), tokens, types_, pad, timeout=600)[0]
    for arch, (ref, before, after, run) in results.items():
        model, cfg, _ = load_model_for_eval(run)
        with torch.no_grad():
            ours = model(tokens)[..., :vocab]
        print(f"{arch}: import {(ours - ref[..., :vocab]).abs().max():.2e}, export {(after - ref)[..., :vocab].abs().max():.2e}")
        torch.testing.assert_close(ours, ref[..., :vocab], rtol=0, atol=1e-5)   # torch_dist in
        assert (before - ref).abs().max() > 1e-2                                 # the fresh model differs ...
        torch.testing.assert_close(after[..., :vocab], ref[..., :vocab], rtol=0, atol=1e-5)  # ... until it loads ours
        assert (cfg.model.position_embedding == "rope") == (arch == "llama")
