"""Export a checkpoint of this project as a Megatron-LM checkpoint (``--ckpt-format torch``), at any TP x PP.

    python -m training.tools.export_megatron --checkpoint RUN_DIR --out DIR [--tp K] [--pp P] \\
        [--vp V] [--layout core|legacy] [--format torch|torch_dist] [--iteration N] [--overwrite]

Writes what Megatron-LM's ``--save`` writes: ``DIR/latest_checkpointed_iteration.txt`` and
``DIR/iter_XXXXXXX/mp_rank_XX[_YYY]/model_optim_rng.pt`` (one per TP rank, ``_YYY`` the pipeline stage when
P > 1), each ``{"model", "args", "iteration", "checkpoint_version": 3.0}``: weights only (load them in Megatron-LM
with ``--finetune`` or ``--no-load-optim --no-load-rng``, and ``--use-checkpoint-args`` or the same model flags).

``--layout core`` (default): Megatron-Core's ``GPTModel``/``BertModel`` state dict (``decoder.layers.i...``,
``linear_qkv``, the local-spec norm names: ``--transformer-impl local``); ``legacy``: ``megatron/legacy/model``'s
nested ``language_model`` dict (``--use-legacy-models``). The names are the inverse of the import's
(:mod:`training.tools.megatron_names`), the QKV rows per key/value group and SwiGLU's ``[gate_r; up_r]`` per TP rank
as :mod:`training.tools.megatron_weights` reads them, the vocabulary padded as Megatron pads it for K ranks
(``make_vocab_size_divisible_by`` x K; the padding rows zero). The layers are split evenly over P stages, Megatron's
default (``--num-layers`` must divide); the last stage of a tied model holds the output copy Megatron keeps there.
``--format torch_dist`` (Megatron-LM's default ``--ckpt-format``; Megatron-Core layout) writes every tensor whole in
one ``iter_XXXXXXX/`` folder (:mod:`training.tools.torch_dist_writer`), which Megatron-LM loads at any TP x PP; K
only pads the vocabulary. ``--vp V`` writes a virtual pipeline (Megatron's interleaved schedule, ``--num-layers-per-virtual-pipeline-stage``
L/(P V)): every rank file holds ``model0`` ... ``model{V-1}``, chunk c of pipeline rank r being virtual stage c P + r
(layers from c L/V + r L/(P V)), the embedding in rank 0's first chunk and the head in rank P-1's last.

The ``args`` carry Megatron's names for the model config (``num_layers``, ``hidden_size``, ``ffn_hidden_size``,
``num_attention_heads``, ``kv_channels``, ``max_position_embeddings``, ``seq_length``, ``padded_vocab_size``, the
GeLU flags, ``position_embedding_type``, ``rotary_base``, ``normalization``, ``swiglu``, ``group_query_attention``,
``num_query_groups``, ``untie_embeddings_and_output_weights``, ``add_bias_linear``, ``add_qkv_bias``, ...) and
``tokenizer_type`` for the GPT-2 BPE and WordPiece tokenizers, whose files are copied to ``DIR/tokenizer``. What
Megatron's models do not compute is refused in one line (Llama 3.1 RoPE scaling, post-LN BERT, a fine-tuned
multiple-choice head). Written to a temporary sibling and renamed into place.
"""
from __future__ import annotations

if __name__ == "__main__":  # run as `python -m`: process settings before torch loads
    from training.runtime.process_env import configure

    configure()

import argparse
import logging
import shutil
import sys
from pathlib import Path

import torch

from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.errors import SuiteError
from megatron_ds_suite.core.program import prog as program
from training.checkpoint_reader import load_merged_state_dict
from training.models.config import ModelConfig, padded_vocab_size
from training.models.qkv import split_qkv
from training.parallel.sharding import resize_vocab_rows
from training.runtime.run_lock import lock_existing_output, overlapping_input
from training.tools.megatron_names import megatron_name, split_dim
from training.tools.megatron_reader import FILE, TRACKER
from training.tools.torch_dist_writer import write_torch_dist

logger = logging.getLogger(__name__)

VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight", "lm_head.bias")
TOKENIZER_TYPES = {"gpt2_bpe": "GPT2BPETokenizer"}


MEGATRON_ROPE = (1.0, 4.0, 8192)
"""Llama 3 RoPE scaling's low and high frequency factors and original context, fixed in Megatron-Core's
``RotaryEmbedding._apply_scaling`` (``--use-rope-scaling``; ``--rope-scaling-factor`` is the one option)."""


class ExportMegatronError(SuiteError):
    """A checkpoint that cannot be written as a Megatron-LM checkpoint (one line)."""


def refuse_unsupported(m: ModelConfig, pp: int, vp: int = 1) -> None:
    bad = []
    if m.sliding_window is not None:
        bad.append(f"model.sliding_window={m.sliding_window} (Megatron-Core's --window-size is not written here)")
    r = m.rope_scaling
    if r is not None and (r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings) != MEGATRON_ROPE:
        bad.append(f"model.rope_scaling with low_freq_factor={r.low_freq_factor:g}, high_freq_factor="
                   f"{r.high_freq_factor:g}, original_max_position_embeddings={r.original_max_position_embeddings} "
                   f"(Megatron-Core's --use-rope-scaling fixes them at 1, 4 and 8192; only the factor is an option)")
    if m.arch == "bert" and m.layer_order != "pre_ln":
        bad.append(f"model.layer_order={m.layer_order} (Megatron's BERT is pre-LN)")
    if m.arch == "bert" and m.head != "pretrain":
        bad.append(f"model.head={m.head} (Megatron's BertModel has the pretraining heads only)")
    if m.arch == "bert" and m.lm_head_activation not in (None, "gelu") and m.activation != "gelu_new":
        bad.append(f"model.lm_head_activation={m.lm_head_activation}")
    if m.num_layers % (pp * vp):
        bad.append(f"--pp {pp}{f' x --vp {vp}' if vp > 1 else ''} with {m.num_layers} layers (Megatron splits the "
                   f"layers evenly)")
    if vp > 1 and pp < 2:
        bad.append(f"--vp {vp} with --pp {pp} (a virtual pipeline needs --pp >= 2)")
    if bad:
        raise ExportMegatronError(f"cannot write a Megatron-LM checkpoint of this model: {'; '.join(bad)}")


def gelu_flags(m: ModelConfig) -> dict:
    """Megatron's GeLU flags for our activations (the inverse of the import's ``gelu_flavours``): its MLP's fused
    bias-GeLU is the tanh form; ``openai_gelu`` makes BERT's LM head tanh too."""
    if m.activation == "swiglu":
        return {"swiglu": True, "bias_gelu_fusion": False, "openai_gelu": False}
    tanh_head = m.arch == "bert" and (m.lm_head_activation or m.activation) == "gelu_new"
    return {"swiglu": False, "bias_gelu_fusion": m.activation == "gelu_new" and not tanh_head, "openai_gelu": tanh_head}


def megatron_args(m: ModelConfig, vocab: int, tp: int, pp: int, iteration: int, layout: str,
                  tokenizer_kind: str | None, lowercase: bool, vp: int = 1) -> argparse.Namespace:
    """The ``args`` Megatron-LM saves with its checkpoints, for our model config."""
    rope = m.position_embedding == "rope"
    groups = m.query_groups
    kind = TOKENIZER_TYPES.get(tokenizer_kind or "")
    if tokenizer_kind == "wordpiece":
        kind = "BertWordPieceLowerCase" if lowercase else "BertWordPieceCase"
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_size,
        num_attention_heads=m.num_attention_heads, kv_channels=m.hidden_size // m.num_attention_heads,
        max_position_embeddings=m.positions, seq_length=m.seq_length,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size(vocab, m.make_vocab_size_divisible_by, tp), vocab_size=vocab,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        num_layers_per_virtual_pipeline_stage=m.num_layers // (pp * vp) if vp > 1 else None, layernorm_epsilon=m.layernorm_epsilon,
        norm_epsilon=m.layernorm_epsilon, hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std, apply_query_key_layer_scaling=m.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=m.attention_softmax_in_fp32, **gelu_flags(m), squared_relu=False, onnx_safe=False,
        position_embedding_type="rope" if rope else "learned_absolute", rotary_base=int(m.rotary_base),
        rotary_percent=m.rotary_percent, use_rope_scaling=m.rope_scaling is not None,
        rope_scaling_factor=m.rope_scaling.factor if m.rope_scaling is not None else 8.0, normalization="RMSNorm" if m.normalization == "rmsnorm" else "LayerNorm",
        group_query_attention=groups != m.num_attention_heads, num_query_groups=groups,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        add_bias_linear=m.add_bias_linear, add_qkv_bias=m.qkv_bias,
        apply_residual_connection_post_layernorm=False, bert_binary_head=m.arch == "bert" and m.binary_head,
        num_tokentypes=m.num_tokentypes if m.arch == "bert" else 0, tokenizer_type=kind,
        transformer_impl="local", use_legacy_models=layout == "legacy", ckpt_format="torch", iteration=iteration,
        params_dtype=torch.float32)


def shard(weights: dict[str, torch.Tensor], m: ModelConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s part of every tensor (our names), in Megatron's row orders (module docstring)."""
    heads, groups = m.num_attention_heads, m.query_groups
    out = {}
    for name, t in weights.items():
        if ".attn.qkv." in name:
            q, k, v = split_qkv(t, heads, groups)
            per, hn = heads // groups, k.size(0) // groups
            mine = range(rank * groups // tp, (rank + 1) * groups // tp)
            out[name] = torch.cat([torch.cat([q[g * per * hn:(g + 1) * per * hn], k[g * hn:(g + 1) * hn],
                                              v[g * hn:(g + 1) * hn]]) for g in mine])
        elif m.activation == "swiglu" and ".mlp.fc." in name:
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
        elif split_dim(name) is None:
            out[name] = t
        else:
            out[name] = t.chunk(tp, dim=split_dim(name))[rank]
    return {k: v.contiguous().clone() for k, v in out.items()}


def stage_names(names: list[str], m: ModelConfig, pp: int, stage: int) -> tuple[list[str], int]:
    """(our tensors on pipeline stage ``stage`` of ``pp``, its first layer): the embedding on the first stage, the
    final norm and the heads on the last."""
    per = m.num_layers // pp
    lo, hi = stage * per, (stage + 1) * per
    keep = []
    for name in names:
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        if layer is not None:
            keep += [name] if lo <= layer < hi else []
        elif name.startswith("embedding."):
            keep += [name] if stage == 0 else []
        elif stage == pp - 1:
            keep.append(name)
    return keep, lo


def nest_legacy(flat: dict[str, torch.Tensor]) -> dict:
    """Legacy Megatron's nesting: model[language_model][embedding][<embedding>][param],
    model[language_model][encoder|pooler|output_layer][param name], model[<head>][param]."""
    out: dict = {}
    for name, t in flat.items():
        parts = name.split(".")
        depth = (3 if parts[1] == "embedding" else 2) if parts[0] == "language_model" else 1
        node = out
        for key in parts[:depth]:
            node = node.setdefault(key, {})
        node[".".join(parts[depth:])] = t
    return out


def rank_models(weights: dict[str, torch.Tensor], m: ModelConfig, tp: int, pp: int, layout: str, vp: int = 1
                ) -> dict[tuple[int, int], dict]:
    """{(tp rank, stage): the model entries of its file}: ``{"model": ...}``, or with a virtual pipeline
    ``{"model0": ..., "model1": ...}``, chunk c being virtual stage c pp + stage of pp vp."""
    out = {}
    tied = not m.untie_embeddings_and_output_weights
    stages = pp * vp
    for rank in range(tp):
        mine = shard(weights, m, tp, rank)
        chunks: dict[int, dict] = {}
        for virtual in range(stages):
            names, first = stage_names(list(mine), m, stages, virtual)
            flat = {megatron_name(n, layout, m.arch, first): mine[n] for n in names}
            if tied and stages > 1 and virtual == stages - 1:  # the output copy Megatron keeps on the last stage
                copy = "output_layer.weight" if layout == "core" else "word_embeddings_for_head.weight"
                flat[copy] = mine["embedding.word_embeddings.weight"].clone()
            chunks[virtual] = flat if layout == "core" else nest_legacy(flat)
        for stage in range(pp):
            out[(rank, stage)] = ({"model": chunks[stage]} if vp == 1 else
                                  {f"model{c}": chunks[c * pp + stage] for c in range(vp)})
    return out


def write_rank_files(folder: Path, models: dict[tuple[int, int], dict], pp: int, args: argparse.Namespace,
                     iteration: int) -> None:
    """``--ckpt-format torch``: one ``mp_rank_XX[_YYY]/model_optim_rng.pt`` per (TP rank, stage) in ``folder``."""
    for (rank, stage), entries in models.items():
        d = folder / (f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else ""))
        d.mkdir(parents=True)
        torch.save({**entries, "args": args, "iteration": iteration, "checkpoint_version": 3.0}, d / FILE)


def export_megatron(run_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, layout: str = "core",
                    iteration: int | None = None, overwrite: bool = False, tag: str | None = None,
                    vp: int = 1, fmt: str = "torch") -> Path:
    """Write run ``run_dir``'s checkpoint (``tag``: default the latest) as Megatron-LM's files in ``out``."""
    run_dir, out = Path(run_dir), Path(out)
    overlap = overlapping_input(out, {"--checkpoint": run_dir})
    if overlap:
        raise ExportMegatronError(f"--out {out} {overlap}: choose an --out outside it")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportMegatronError(f"--out {out} exists and is not empty (choose a new folder or pass --overwrite)")
    if tp < 1 or pp < 1 or vp < 1 or layout not in ("core", "legacy"):
        raise ExportMegatronError(f"--tp {tp} --pp {pp} --vp {vp} --layout {layout}: TP, PP and VP >= 1, layout core "
                                  f"or legacy")
    if fmt not in ("torch", "torch_dist") or (fmt == "torch_dist" and layout != "core"):
        raise ExportMegatronError(f"--format {fmt} --layout {layout}: the format is torch or torch_dist, and "
                                  f"torch_dist holds Megatron-Core models only (--layout core)")
    weights, cfg, meta = load_merged_state_dict(run_dir, tag)
    m = cfg.model
    refuse_unsupported(m, pp, vp)
    if m.num_attention_heads % tp or m.query_groups % tp or m.ffn_size % tp:
        raise ExportMegatronError(f"--tp {tp} does not divide the {m.num_attention_heads} heads, {m.query_groups} "
                                  f"key/value groups and MLP width {m.ffn_size} of this model")
    vocab = m.vocab_size
    rows = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, tp)
    weights = {k: (resize_vocab_rows(v[:vocab], rows) if k in VOCAB_ROWS else v) for k, v in weights.items()}
    it = int(meta.get("iteration", 0) if iteration is None else iteration)
    spec = meta.get("tokenizer") or {}
    args = megatron_args(m, vocab, tp, pp, it, layout, spec.get("kind"), bool(spec.get("lowercase", True)), vp)
    lock = lock_existing_output(out)
    try:
        with atomic.atomic_dir(out) as tmp:  # a failed export leaves the previous folder (or none)
            if fmt == "torch_dist":
                flat = rank_models(weights, m, 1, 1, layout)[(0, 0)]["model"]
                write_torch_dist(tmp / f"iter_{it:07d}", flat, m.num_layers, not m.untie_embeddings_and_output_weights,
                                 args, it)
            else:
                write_rank_files(tmp / f"iter_{it:07d}", rank_models(weights, m, tp, pp, layout, vp), pp, args, it)
            (tmp / TRACKER).write_text(str(it))
            if (run_dir / "tokenizer").is_dir():
                shutil.copytree(run_dir / "tokenizer", tmp / "tokenizer")
    finally:
        if lock is not None:
            lock.release()
    logger.info("wrote %s: Megatron-LM %s layout, TP=%d PP=%d VP=%d, iteration %d", out, layout, tp, pp, vp, it)
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog=program("python -m training.tools.export_megatron"),
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="run directory of this project")
    ap.add_argument("--tag", default=None, help="checkpoint tag (default: the latest)")
    ap.add_argument("--out", required=True, help="new folder: Megatron-LM's --load folder")
    ap.add_argument("--tp", type=int, default=1, help="Megatron's --tensor-model-parallel-size")
    ap.add_argument("--pp", type=int, default=1, help="Megatron's --pipeline-model-parallel-size")
    ap.add_argument("--vp", type=int, default=1, help="Megatron's --virtual-pipeline-model-parallel-size (model chunks "
                    "per pipeline rank, for its interleaved schedule)")
    ap.add_argument("--layout", choices=("core", "legacy"), default="core",
                    help="Megatron-Core's model (default) or --use-legacy-models")
    ap.add_argument("--format", choices=("torch", "torch_dist"), default="torch",
                    help="Megatron-LM's --ckpt-format: rank files (default) or one distributed checkpoint")
    ap.add_argument("--iteration", type=int, default=None, help="iteration to record (default: the checkpoint's)")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    a = ap.parse_args(argv)
    try:
        export_megatron(a.checkpoint, a.out, a.tp, a.pp, a.layout, a.iteration, a.overwrite, a.tag, a.vp, a.format)
    except ValueError as e:  # ExportMegatronError, CheckpointError, ...: one line
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
