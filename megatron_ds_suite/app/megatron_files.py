"""A tiny Megatron-LM GPT-2 checkpoint in the legacy file layout, for the import tests and the hostile probe.

:func:`write_megatron_gpt2` draws the full (TP=1) tensors of a small GPT-2 from a seeded generator and writes them
the way Megatron-LM's ``--save`` does: ``{save}/iter_XXXXXXX/mp_rank_XX[_YYY]/model_optim_rng.pt`` per TP rank and
pipeline stage plus ``latest_checkpointed_iteration.txt``; ``model -> language_model -> embedding / encoder``,
``args`` an ``argparse.Namespace`` with Megatron's argument names (``rank`` differs per file, as in Megatron),
checkpoint_version 3.0 (QKV rows per head ``[q; k; v]`` inside each rank's heads). Split as Megatron splits: QKV and
``dense_h_to_4h`` by rows (heads / MLP columns), ``dense`` and ``dense_4h_to_h`` by input columns, the word
embedding by vocabulary rows (padded to a multiple of ``make_vocab_size_divisible_by`` x TP); every other tensor
replicated. Needs only torch (no Megatron): the files it writes are what :mod:`training.tools.import_megatron`
reads, and their hostile variants are made from them.
"""
from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import torch


def megatron_args(tp: int, pp: int, layers: int, hidden: int, heads: int, positions: int, vocab: int,
                  divisible_by: int, iteration: int) -> argparse.Namespace:
    padded = -(-vocab // (divisible_by * tp)) * divisible_by * tp
    return argparse.Namespace(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=heads,
        kv_channels=hidden // heads, max_position_embeddings=positions, seq_length=positions,
        make_vocab_size_divisible_by=divisible_by, padded_vocab_size=padded, layernorm_epsilon=1e-5,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, bias_gelu_fusion=True, openai_gelu=False,
        apply_query_key_layer_scaling=False, attention_softmax_in_fp32=False, hidden_dropout=0.1,
        attention_dropout=0.1, init_method_std=0.02, position_embedding_type="learned_absolute",
        normalization="LayerNorm", add_bias_linear=True, swiglu=False, transformer_impl="local",
        untie_embeddings_and_output_weights=False, tokenizer_type="GPT2BPETokenizer", iteration=iteration, rank=0)


def gpt2_tensors(layers: int, hidden: int, positions: int, padded: int, seed: int) -> dict[str, torch.Tensor]:
    """Full tensors in our names (``training.tools.import_megatron``'s map), vocabulary rows ``padded``."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    out = {"embedding.word_embeddings.weight": r(padded, hidden), "embedding.position_embeddings.weight": r(positions, hidden)}
    for i in range(layers):
        a = f"layers.{i}."
        out.update({a + "ln1.weight": 1 + r(hidden), a + "ln1.bias": r(hidden), a + "attn.qkv.weight": r(3 * hidden, hidden),
                    a + "attn.qkv.bias": r(3 * hidden), a + "attn.proj.weight": r(hidden, hidden), a + "attn.proj.bias": r(hidden),
                    a + "ln2.weight": 1 + r(hidden), a + "ln2.bias": r(hidden), a + "mlp.fc.weight": r(4 * hidden, hidden),
                    a + "mlp.fc.bias": r(4 * hidden), a + "mlp.proj.weight": r(hidden, 4 * hidden), a + "mlp.proj.bias": r(hidden)})
    out.update({"final_ln.weight": 1 + r(hidden), "final_ln.bias": r(hidden)})
    return out


def _qkv_shard(full: torch.Tensor, heads: int, rank: int, tp: int) -> torch.Tensor:
    """Rows [Q; K; V] of ``full`` -> rank ``rank``'s version-3.0 shard: per head of its own, q rows, k rows, v rows."""
    q, k, v = full.chunk(3)
    hn = q.size(0) // heads
    per = heads // tp
    rows = []
    for h in range(rank * per, (rank + 1) * per):
        rows += [t[h * hn:(h + 1) * hn] for t in (q, k, v)]
    return torch.cat(rows).contiguous()


def _megatron_layer(ours: str) -> str:
    return {"ln1": "input_layernorm", "ln2": "post_attention_layernorm", "attn.qkv": "self_attention.query_key_value",
            "attn.proj": "self_attention.dense", "mlp.fc": "mlp.dense_h_to_4h", "mlp.proj": "mlp.dense_4h_to_h"}[ours]


def write_megatron_gpt2(save: Path, tp: int = 2, pp: int = 1, layers: int = 2, hidden: int = 16, heads: int = 4,  # noqa: C901
                        positions: int = 32, vocab: int = 50257, divisible_by: int = 128, iteration: int = 7,
                        seed: int = 0) -> dict[str, torch.Tensor]:
    """Write the checkpoint (module docstring) under ``save``; returns its full tensors in our names (the word
    embedding with Megatron's padding rows)."""
    args = megatron_args(tp, pp, layers, hidden, heads, positions, vocab, divisible_by, iteration)
    full = gpt2_tensors(layers, hidden, positions, args.padded_vocab_size, seed)
    per_stage = layers // pp
    folder = Path(save) / f"iter_{iteration:07d}"
    for r in range(tp):
        for s in range(pp):
            emb, enc = {}, {}
            if s == 0:
                emb["word_embeddings"] = {"weight": full["embedding.word_embeddings.weight"].chunk(tp)[r].clone()}
                emb["position_embeddings"] = {"weight": full["embedding.position_embeddings.weight"].clone()}
            for i in range(s * per_stage, (s + 1) * per_stage):
                for name, t in full.items():
                    if not name.startswith(f"layers.{i}."):
                        continue
                    body, kind = name[len(f"layers.{i}."):].rsplit(".", 1)
                    if body == "attn.qkv":
                        t = _qkv_shard(t, heads, r, tp)
                    elif body == "mlp.fc":
                        t = t.chunk(tp)[r]
                    elif body in ("attn.proj", "mlp.proj") and kind == "weight":
                        t = t.chunk(tp, dim=1)[r]
                    enc[f"layers.{i - s * per_stage}.{_megatron_layer(body)}.{kind}"] = t.clone()
            state: dict = {"language_model": {}}
            if emb:
                state["language_model"]["embedding"] = emb
            if s == pp - 1:
                enc["final_layernorm.weight"] = full["final_ln.weight"].clone()
                enc["final_layernorm.bias"] = full["final_ln.bias"].clone()
                if pp > 1:
                    state["word_embeddings_for_head"] = {"weight": full["embedding.word_embeddings.weight"].chunk(tp)[r].clone()}
            state["language_model"]["encoder"] = enc
            rank_args = argparse.Namespace(**{**vars(args), "rank": s * tp + r})
            d = folder / (f"mp_rank_{r:02d}" + (f"_{s:03d}" if pp > 1 else ""))
            d.mkdir(parents=True, exist_ok=True)
            torch.save({"args": rank_args, "iteration": iteration, "checkpoint_version": 3.0, "model": state,
                        "rng_state": [{"random_rng_state": (3, tuple(range(5)), None)}]}, d / "model_optim_rng.pt")
    (Path(save) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return full


# --- hostile structures (what a crafted pickle can hold), for the tests and the probe ------------------------------
def shared_dicts(levels: int, leaf) -> dict:
    """A 'billion laughs' of dicts: every level holds the next one twice, so one small object (a pickle of about a
    kilobyte) is reachable by ``2 ** levels`` paths."""
    d = {"w": leaf}
    for _ in range(levels):
        d = {"a": d, "b": d}
    return d


def nested_dicts(levels: int, leaf) -> dict:
    """``levels`` dicts, each inside the next (``{"x": {"x": ... {"w": leaf}}}``)."""
    d = {"w": leaf}
    for _ in range(levels):
        d = {"x": d}
    return d


def torch_save_deep(obj, path: Path) -> None:
    """``torch.save`` of a structure nested deeper than the default recursion limit (the pickler recurses, the
    weights-only unpickler does not), from a thread with a large stack."""
    limit, size = sys.getrecursionlimit(), threading.stack_size(512 << 20)
    try:
        sys.setrecursionlimit(100_000)
        t = threading.Thread(target=torch.save, args=(obj, path))
        t.start()
        t.join()
    finally:
        threading.stack_size(size)
        sys.setrecursionlimit(limit)
