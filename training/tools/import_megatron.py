"""Import a Megatron-LM GPT-2, Llama-shaped or BERT checkpoint (legacy or Megatron-Core layout, ``torch`` or
``torch_dist`` format) into a run directory, at any TP/PP.

    python -m training.tools.import_megatron --checkpoint DIR --out RUN_DIR [--tp K] [--pp P] \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt      # GPT-2 (byte-level BPE)
        --vocab-file bert-vocab.txt [--tokenizer-type BertWordPieceCase] # BERT (WordPiece)

``DIR`` is what Megatron-LM's ``--save`` wrote (``latest_checkpointed_iteration.txt`` naming an iteration or
``release``, ``iter_XXXXXXX/`` or ``release/`` folders), or one such folder. Each holds one
``mp_rank_XX/model_optim_rng.pt`` per tensor-parallel rank (``mp_rank_XX_YYY`` with pipeline stage YYY): any
source TP x PP is merged (a ``torch_dist`` folder, ``metadata.json`` with ``*.distcp`` files, holds every tensor
whole already: :mod:`training.tools.torch_dist_reader`), then written at ``--tp`` x ``--pp`` in the layout training reads, with the same
machinery as :mod:`training.tools.import_hf` (run lock, refusal of a non-empty ``--out``, tokenizer identity).
Weights only: the optimizer, schedule and RNG states in the files are not carried over.

The rank files are read and checked by :mod:`training.tools.megatron_reader` (loaded without running code, one
checkpoint's files, the args type-checked), their tensors renamed and merged to TP=1 by
:mod:`training.tools.megatron_weights` (the name map and the QKV row orders are documented there); the merged
weights are checked against our model (names, shapes, finite values) before anything is written.

The model config comes from the file's ``args`` (num_layers, hidden_size, num_attention_heads,
max_position_embeddings, make_vocab_size_divisible_by, layernorm_epsilon, the GeLU flavour, query-key layer
scaling); shapes are checked against the tensors. Files without ``args`` (the oldest releases) need
``--num-attention-heads``. The Llama options (RoPE with its base, fraction and Llama 3.1 scaling, RMSNorm, SwiGLU,
grouped-query attention, untied output, no biases) are read (:func:`llama_options`); what our model cannot compute
(post-LayerNorm residuals, MoE, query/key norms, interleaved rotary, ...) is refused in one line.

GeLU: Megatron's MLP uses the fused bias-GeLU kernel (tanh approximation) when ``bias_gelu_fusion`` is on
(its default) and ``openai_gelu`` is off, else the exact erf GeLU; BERT's LM head always uses the exact one
unless ``openai_gelu`` -> ``model.activation`` and ``model.lm_head_activation``.

Megatron checkpoints carry no vocabulary: ``--vocab-file``/``--merge-file`` as in Megatron's own command
line. The vocabulary size Megatron padded (``make_vocab_size_divisible_by`` x source TP) must match the
embedding rows, which catches a wrong vocabulary file.
"""
from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

import torch

from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.program import prog as program
from training.config import Config, validate_static
from training.models.config import ModelConfig, RopeScalingConfig, padded_vocab_size
from training.runtime.run_lock import lock_existing_output, overlapping_input
from training.tools.import_hf import write_checkpoint
from training.tools.megatron_reader import ImportMegatronError, find_checkpoint, megatron_arg
from training.tools.megatron_weights import read_global_weights, read_weights
from training.tools.tensor_check import few

logger = logging.getLogger(__name__)

TOKENIZERS = ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase")


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------
LLAMA_OPTIONS = ("position_embedding_type", "normalization", "swiglu", "group_query_attention",
                 "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias")
"""Megatron options our GPT computes (its Llama options) but our BERT does not."""


def refuse_unsupported(args, arch: str) -> None:
    """One line naming every Megatron option our model does not compute (BERT: also the Llama options)."""
    if args is None:
        return
    checks = {
        "position_embedding_type": ("learned_absolute", "rope", None),
        "normalization": ("LayerNorm", "RMSNorm", None),
        "swiglu": (False, True, None), "squared_relu": (False, None), "onnx_safe": (False, None),
        "group_query_attention": (False, True, None),
        "untie_embeddings_and_output_weights": (False, True, None),
        "apply_residual_connection_post_layernorm": (False, None),
        "add_bias_linear": (True, False, None), "add_qkv_bias": (False, True, None),
        "num_experts": (None, 0, 1),
        "transformer_impl": ("local", "transformer_engine", None),
        "qk_layernorm": (False, None), "rotary_interleaved": (False, None),
        "window_size": (None,),
    }
    if arch == "bert":
        checks.update({"position_embedding_type": ("learned_absolute", None), "normalization": ("LayerNorm", None),
                       "swiglu": (False, None), "group_query_attention": (False, None),
                       "untie_embeddings_and_output_weights": (False, None), "add_bias_linear": (True, None),
                       "add_qkv_bias": (False, None)})
    bad = []
    for key, ok in checks.items():
        value = getattr(args, key, None)
        if value not in ok and str(value) not in map(str, ok):
            bad.append(f"{key}={value!r}")
    h, n = megatron_arg(args, "hidden_size"), megatron_arg(args, "num_attention_heads")
    kv = megatron_arg(args, "kv_channels")
    if kv is not None and h is not None and n is not None and kv * n != h:
        bad.append(f"kv_channels={kv} (not hidden_size / num_attention_heads)")
    if bad:
        model = "BERT (learned positions, LayerNorm, GeLU, tied)" if arch == "bert" else "GPT"
        raise ImportMegatronError(f"the checkpoint's args set {', '.join(bad)}, which this project's {model} does not "
                                  f"compute")


def gelu_flavours(args, arch: str) -> tuple[str, str | None]:
    """(model.activation, model.lm_head_activation) of Megatron's GeLU flags (module docstring)."""
    if args is None:  # releases without args predate the flags: their GeLU was OpenAI's tanh form
        return "gelu_new", None
    openai = bool(getattr(args, "openai_gelu", False))
    fused = bool(getattr(args, "bias_gelu_fusion", False))
    mlp = "gelu_new" if openai or fused else "gelu"
    head = "gelu_new" if openai else "gelu"
    return mlp, (head if arch == "bert" and head != mlp else None)


def llama_options(args) -> dict:
    """Our ModelConfig's Llama options from Megatron's args (RoPE and its base and fraction, Llama 3's RoPE scaling,
    RMSNorm, SwiGLU, grouped-query attention, untied output, biases); {} without args (the oldest releases had
    none). Megatron-Core's ``--use-rope-scaling`` fixes everything but the factor (``--rope-scaling-factor``,
    default 8): low/high frequency factors 1 and 4 over an original context of 8192, ``RopeScalingConfig``'s
    defaults."""
    if args is None:
        return {}
    out: dict = {}
    if megatron_arg(args, "position_embedding_type") == "rope":
        out.update(position_embedding="rope", rotary_base=float(megatron_arg(args, "rotary_base", 10000)),
                   rotary_percent=float(megatron_arg(args, "rotary_percent", 1.0)))
        if megatron_arg(args, "use_rope_scaling", False):
            out["rope_scaling"] = RopeScalingConfig(factor=float(megatron_arg(args, "rope_scaling_factor", 8.0)))
    if megatron_arg(args, "normalization") == "RMSNorm":
        out["normalization"] = "rmsnorm"
    if megatron_arg(args, "swiglu", False):
        out["activation"] = "swiglu"
    if megatron_arg(args, "group_query_attention", False):
        groups = megatron_arg(args, "num_query_groups")
        out["num_query_groups"] = None if groups == megatron_arg(args, "num_attention_heads") else groups
    if megatron_arg(args, "untie_embeddings_and_output_weights", False):
        out["untie_embeddings_and_output_weights"] = True
    if not megatron_arg(args, "add_bias_linear", True):
        out.update(add_bias_linear=False, add_qkv_bias=bool(megatron_arg(args, "add_qkv_bias", False)))
    return out


def model_config(weights: dict[str, torch.Tensor], args, heads: int, vocab_size: int,
                 seq_length: int | None) -> ModelConfig:
    """Our ModelConfig from Megatron's args and the tensors' shapes (they must agree)."""
    arch = "bert" if "lm_head.bias" in weights else "gpt2"
    refuse_unsupported(args, arch)
    options = llama_options(args)
    layers = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("layers."))
    hidden = weights["embedding.word_embeddings.weight"].size(1)
    table = weights.get("embedding.position_embeddings.weight")
    if (table is None) != (options.get("position_embedding") == "rope"):
        raise ImportMegatronError("the checkpoint's position embeddings disagree with its args "
                                  f"(position_embedding_type={megatron_arg(args, 'position_embedding_type')!r}, "
                                  f"position table {'absent' if table is None else 'present'}): a damaged checkpoint")
    positions = megatron_arg(args, "max_position_embeddings") if table is None else table.size(0)
    positions = positions or seq_length or megatron_arg(args, "seq_length")
    ffn = weights["layers.0.mlp.fc.weight"].size(0) // (2 if options.get("activation") == "swiglu" else 1)
    if args is not None:
        said = {k: megatron_arg(args, k) for k in ("num_layers", "hidden_size", "max_position_embeddings")}
        found = {"num_layers": layers, "hidden_size": hidden, "max_position_embeddings": positions}
        diff = [f"{k}={said[k]} (tensors: {found[k]})" for k in said if said[k] is not None and said[k] != found[k]]
        if diff:
            raise ImportMegatronError(f"the checkpoint's args disagree with its tensors: {', '.join(diff)}")
    if hidden % heads:
        raise ImportMegatronError(f"hidden size {hidden} is not a multiple of {heads} attention heads")
    seq = seq_length or megatron_arg(args, "seq_length") or positions
    if seq > positions:
        raise ImportMegatronError(f"--seq-length {seq} exceeds the model's {positions} positions")
    activation, head_activation = gelu_flavours(args, arch)
    cfg = ModelConfig(arch=arch, num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                      max_position_embeddings=positions, vocab_size=vocab_size,
                      make_vocab_size_divisible_by=int(megatron_arg(args, "make_vocab_size_divisible_by", 128)),
                      ffn_hidden_size=ffn, hidden_dropout=float(megatron_arg(args, "hidden_dropout", 0.1)),
                      attention_dropout=float(megatron_arg(args, "attention_dropout", 0.1)),
                      init_method_std=float(megatron_arg(args, "init_method_std", 0.02)),
                      layernorm_epsilon=float(megatron_arg(args, "layernorm_epsilon",
                                                           megatron_arg(args, "norm_epsilon", 1e-5))),
                      apply_query_key_layer_scaling=bool(megatron_arg(args, "apply_query_key_layer_scaling", False)),
                      attention_softmax_in_fp32=bool(megatron_arg(args, "attention_softmax_in_fp32", False)),
                      activation=activation)
    for key, value in options.items():
        setattr(cfg, key, value)
    if arch == "bert":
        types = weights.get("embedding.tokentype_embeddings.weight")
        cfg.num_tokentypes = 0 if types is None else types.size(0)
        cfg.binary_head = "binary_head.weight" in weights
        cfg.layer_order = "pre_ln"
        cfg.lm_head_activation = head_activation
    return cfg


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------
def import_tokenizer(kind: str, vocab_file: str | None, merge_file: str | None, dest: Path):
    """Copy Megatron's tokenizer files into ``dest``; (tokenizer, spec relative to the run directory with the
    files' sizes and sha256, as training records them)."""
    from megatron_ds_suite.core.tokenizer import load_tokenizer

    if vocab_file is None or not Path(vocab_file).is_file():
        raise ImportMegatronError(f"--vocab-file {vocab_file}: no such file (Megatron checkpoints hold no vocabulary: "
                                  f"pass the one the model was trained with)")
    dest.mkdir(parents=True, exist_ok=True)
    if kind == "GPT2BPETokenizer":
        if merge_file is None or not Path(merge_file).is_file():
            raise ImportMegatronError(f"--merge-file {merge_file}: no such file (GPT2BPETokenizer needs the merges)")
        shutil.copyfile(vocab_file, dest / "vocab.json")
        shutil.copyfile(merge_file, dest / "merges.txt")
        spec = {"kind": "gpt2_bpe", "vocab_file": "tokenizer/vocab.json", "merges_file": "tokenizer/merges.txt"}
    else:
        shutil.copyfile(vocab_file, dest / "vocab.txt")
        spec = {"kind": "wordpiece", "vocab_file": "tokenizer/vocab.txt", "lowercase": kind == "BertWordPieceLowerCase"}
    tok = load_tokenizer(spec, base_dir=dest.parent)
    full = tok.spec()
    return tok, {**full, **spec}


def tokenizer_kind(args, arch: str, given: str | None) -> str:
    kind = given or megatron_arg(args, "tokenizer_type") or ("GPT2BPETokenizer" if arch == "gpt2" else "BertWordPieceLowerCase")
    if kind not in TOKENIZERS:
        raise ImportMegatronError(f"tokenizer type {kind!r} is not supported ({', '.join(TOKENIZERS)})")
    if (kind == "GPT2BPETokenizer") != (arch == "gpt2"):
        raise ImportMegatronError(f"tokenizer type {kind} does not fit a {arch} checkpoint")
    return kind


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------
def import_megatron(checkpoint: str | Path, out: str | Path, tp: int = 1, pp: int = 1, *, vocab_file: str | None = None,
                    merge_file: str | None = None, tokenizer_type: str | None = None,
                    num_attention_heads: int | None = None, seq_length: int | None = None,
                    overwrite: bool = False) -> Path:
    """Import Megatron-LM checkpoint ``checkpoint`` into run directory ``out`` at TP=``tp`` x PP=``pp``; written
    to a temporary sibling and renamed into place (a failure leaves nothing half-written), under ``out``'s run
    lock when it exists."""
    src, out = Path(checkpoint), Path(out)
    overlap = overlapping_input(out, {"--checkpoint": src})
    if overlap:
        raise ImportMegatronError(f"--out {out} {overlap}: choose an --out outside it")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ImportMegatronError(f"--out {out} exists and is not empty (choose a new run directory or pass --overwrite)")
    if tp < 1 or pp < 1:
        raise ImportMegatronError(f"--tp and --pp must be >= 1, got {tp} and {pp}")
    folder, files = find_checkpoint(src)
    lock = lock_existing_output(out)
    try:
        return _import(folder, files, out, tp, pp, vocab_file, merge_file, tokenizer_type, num_attention_heads,
                       seq_length)
    finally:
        if lock is not None:
            lock.release()


def _import(folder: Path, files, out: Path, tp: int, pp: int, vocab_file, merge_file, tokenizer_type, heads,
            seq_length) -> Path:
    weights, args, version, (src_tp, src_pp) = read_weights(files, heads) if files else read_global_weights(folder, heads)
    need = ["embedding.word_embeddings.weight", "layers.0.mlp.fc.weight"]
    lacking = [n for n in need if n not in weights]
    if lacking:
        raise ImportMegatronError(f"{folder} holds no {few(lacking)} (our names for Megatron's tensors): not a "
                                  f"Megatron-LM GPT-2/BERT model")
    heads = heads or megatron_arg(args, "num_attention_heads")
    arch = "bert" if "lm_head.bias" in weights else "gpt2"
    kind = tokenizer_kind(args, arch, tokenizer_type)
    rows = weights["embedding.word_embeddings.weight"].size(0)
    with atomic.atomic_dir(out) as tmp:  # a failed import leaves the previous folder (or none)
        tok, spec = import_tokenizer(kind, vocab_file, merge_file, tmp / "tokenizer")
        model_cfg = model_config(weights, args, heads, tok.vocab_size, seq_length)
        megatron_rows = padded_vocab_size(tok.vocab_size, model_cfg.make_vocab_size_divisible_by, src_tp)
        if rows != megatron_rows:
            raise ImportMegatronError(
                f"the embedding has {rows} rows but Megatron pads this {tok.vocab_size}-token vocabulary to "
                f"{megatron_rows} at TP={src_tp}: the wrong --vocab-file for this checkpoint?")
        cfg = Config(model=model_cfg)
        cfg.parallel.tensor, cfg.parallel.pipeline = tp, pp
        cfg.run.dir = str(out)
        validate_static(cfg)  # TP divides heads and MLP width, PP <= layers, PP only for GPT-2
        vocab_rows = ("embedding.word_embeddings.weight", "output_layer.weight", "lm_head.bias")
        weights = {k: (v[:tok.vocab_size] if k in vocab_rows else v) for k, v in weights.items()}
        write_checkpoint(tmp, cfg, weights, spec, str(folder))
    logger.info("imported %s (Megatron-LM %s, checkpoint_version %s, TP=%d PP=%d) -> %s (TP=%d PP=%d, %d layers, "
                "hidden %d, vocab %d)", folder, model_cfg.arch, version, src_tp, src_pp, out, tp, pp,
                model_cfg.num_layers, model_cfg.hidden_size, model_cfg.vocab_size)
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog=program("python -m training.tools.import_megatron"),
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True,
                    help="Megatron-LM --save folder (with latest_checkpointed_iteration.txt) or one iter_*/release folder")
    ap.add_argument("--out", required=True, help="new run directory")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the written checkpoint")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree of the written checkpoint (GPT-2)")
    ap.add_argument("--vocab-file", help="GPT-2 vocab.json or BERT vocab.txt the model was trained with")
    ap.add_argument("--merge-file", help="GPT-2 merges.txt")
    ap.add_argument("--tokenizer-type", choices=TOKENIZERS, default=None,
                    help="Megatron's tokenizer name (default: the checkpoint's args)")
    ap.add_argument("--num-attention-heads", type=int, default=None,
                    help="for checkpoints without args (the oldest releases)")
    ap.add_argument("--seq-length", type=int, default=None, help="model.seq_length (default: the checkpoint's)")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    a = ap.parse_args(argv)
    try:
        import_megatron(a.checkpoint, a.out, a.tp, a.pp, vocab_file=a.vocab_file, merge_file=a.merge_file,
                        tokenizer_type=a.tokenizer_type, num_attention_heads=a.num_attention_heads,
                        seq_length=a.seq_length, overwrite=a.overwrite)
    except ValueError as e:  # ImportMegatronError, CheckpointError, ConfigError, TokenizerError: one line
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
