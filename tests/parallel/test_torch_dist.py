"""Megatron-LM's ``torch_dist`` format both ways (issue 44): a checkpoint Megatron-Core's own
``dist_checkpointing.save`` writes from TP=2 imports with Megatron's logits, and ``export_megatron --format
torch_dist`` writes files Megatron-Core's ``dist_checkpointing.load`` reads into a fresh TP=2 model that then gives
the same logits (fp32, 1e-5). GPT-2 (tied, learned positions, LayerNorm), the Llama shape (RoPE, RMSNorm, SwiGLU,
grouped-query attention, untied, no biases) and BERT (its binary head's logits too, over a padded batch), two gloo
ranks, one launch; CPU shims as in tests/helpers/megatron_core_models.py."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.megatron_core_models import (
    GPT2_DIR,
    LLAMA_ARGS,
    S,
    inputs,
    megatron_args,
    megatron_logits,
    megatron_model,
    noise,
    write_bert_vocab,
)

ITERATION = 9


def _worker(rank: int, world: int, specs: dict, root: str) -> dict:
    """For each architecture: Megatron-Core's model (with noise) saved by ``dist_checkpointing``, imported and
    exported by rank 0, and loaded into a fresh model: (reference logits, sop, fresh logits, loaded logits, loaded sop,
    our run)."""
    from megatron.core import dist_checkpointing, parallel_state

    from training.tools.export_megatron import export_megatron
    from training.tools.import_megatron import import_megatron

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.cuda.synchronize = lambda *a, **k: None  # the saver waits for device copies and reduces its failure flags
    torch.cuda.current_device = lambda: "cpu"     # on the "current device": on the CPU here
    out = {}
    for arch, (padded, vocab, files, (tokens, types_, pad)) in specs.items():
        torch.manual_seed(1234)
        model = megatron_model(arch, world, padded)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(noise(name, rank, getattr(p, "tensor_model_parallel", False), p.shape))
        ref, ref_sop = megatron_logits(model, arch, world, tokens, types_, pad)
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
            import_megatron(save, run, 1, 1, **files)
            export_megatron(run, back, tp=world, iteration=ITERATION, fmt="torch_dist")
        torch.distributed.barrier()
        torch.manual_seed(99)
        fresh = megatron_model(arch, world, padded)
        before, _ = megatron_logits(fresh, arch, world, tokens, types_, pad)
        with torch.serialization.safe_globals([argparse.Namespace]):  # as Megatron-LM's checkpointing allows it
            loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()}, str(back / f"iter_{ITERATION:07d}"))
        assert loaded["iteration"] == ITERATION and loaded["args"].tensor_model_parallel_size == world
        fresh.load_state_dict(loaded["model"])
        after, after_sop = megatron_logits(fresh, arch, world, tokens, types_, pad)
        out[arch] = (ref, ref_sop, before, after, after_sop, str(run))
    return out


def test_torch_dist_checkpoints_import_and_export_with_megatrons_logits(tmp_path):
    pytest.importorskip("megatron.core", reason="the test extra's megatron-core (Megatron's own modules)")
    from megatron_ds_suite.core.tokenizer import load_tokenizer
    from training.checkpoint_reader import load_model_for_eval

    if not GPT2_DIR.is_dir():
        pytest.skip("../shared/data/tokenizers/gpt2 absent")
    gpt2_files = {"vocab_file": str(GPT2_DIR / "gpt2-vocab.json"), "merge_file": str(GPT2_DIR / "gpt2-merges.txt")}
    gpt2_vocab = load_tokenizer({"kind": "gpt2_bpe", "vocab_file": gpt2_files["vocab_file"],
                                 "merges_file": gpt2_files["merge_file"]}).vocab_size
    bert_files = {"vocab_file": str(write_bert_vocab(tmp_path / "vocab.txt"))}
    specs = {}
    for arch, vocab, files in (("gpt2", gpt2_vocab, gpt2_files), ("llama", gpt2_vocab, gpt2_files),
                               ("bert", 300, bert_files)):
        tokens, types_, pad = inputs(vocab)
        if arch == "bert":
            pad[1, S - 3:] = 0  # padding in the second sample
        specs[arch] = (64 * -(-vocab // 64), vocab, files, (tokens, types_, pad))  # Megatron pads to 32 x TP=2
    results = run_distributed(_worker, 2, specs, str(tmp_path), timeout=900)[0]
    for arch, (ref, ref_sop, before, after, after_sop, run) in results.items():
        vocab, (tokens, types_, pad) = specs[arch][1], specs[arch][3]
        keep = pad.bool()  # Megatron also masks padded queries: padded positions are not compared
        ref = ref[..., :vocab][keep]
        model, cfg, _ = load_model_for_eval(run)
        with torch.no_grad():
            ours, sop = model(tokens, types_, pad) if arch == "bert" else (model(tokens), None)
        ours, after, before = ours[..., :vocab][keep], after[..., :vocab][keep], before[..., :vocab][keep]
        print(f"{arch}: import {(ours - ref).abs().max():.2e}, export {(after - ref).abs().max():.2e}")
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)                 # torch_dist in
        assert (before - ref).abs().max() > 1e-2                                 # the fresh model differs ...
        torch.testing.assert_close(after, ref, rtol=0, atol=1e-5)                # ... until it loads ours
        if arch == "bert":
            torch.testing.assert_close(sop, ref_sop, rtol=0, atol=1e-5)
            torch.testing.assert_close(after_sop, ref_sop, rtol=0, atol=1e-5)
        assert (cfg.model.position_embedding == "rope") == (arch == "llama") and cfg.model.arch == (
            "bert" if arch == "bert" else "gpt2")
