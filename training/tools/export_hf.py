"""Export a GPT-2, Llama-shaped GPT or BERT checkpoint to a Hugging Face ``transformers`` folder.

    python -m training.tools.export_hf --checkpoint RUN_DIR --out DIR [--overwrite] [--no-tokenizer]

BERT goes to ``MegatronBertForPreTraining`` (``layer_order: pre_ln``) or ``BertForPreTraining``
(``post_ln``), see :mod:`training.tools.hf_bert`; a GPT with the Llama options (RoPE, RMSNorm, SwiGLU; GQA,
untied output and biases either way) to ``LlamaForCausalLM``, see :mod:`training.tools.hf_llama`; a GPT with
only some of them has no ``transformers`` class and is refused. The rest of this docstring is about GPT-2.

Writes ``config.json`` (``GPT2Config``), ``model.safetensors`` (TP shards merged by
``training.checkpoint_reader.load_merged_state_dict``, vocabulary padding rows removed) and the tokenizer
(``tokenizer.json`` + configs, see :mod:`training.tools.hf_tokenizer`; GPT-2 BPE also ``vocab.json`` /
``merges.txt``; SentencePiece BPE, the main job's tokenizer, converted with identical ids), so that
``GPT2LMHeadModel.from_pretrained(DIR)`` gives logits equal to ours on the real vocabulary and
``AutoTokenizer.from_pretrained(DIR)`` our ids. Needs the ``hf`` extra (transformers).

Name/layout mapping (HF ``Conv1D`` stores ``[in, out]``, our linears ``[out, in]`` -> transposed):

    embedding.word_embeddings.weight[:V]   -> transformer.wte.weight          (lm_head tied to it)
    embedding.position_embeddings.weight   -> transformer.wpe.weight
    layers.i.ln1 / ln2                     -> transformer.h.i.ln_1 / ln_2
    layers.i.attn.qkv.weight [3h, h]       -> transformer.h.i.attn.c_attn.weight [h, 3h]  (rows [Q;K;V])
    layers.i.attn.proj.weight [h, h]       -> transformer.h.i.attn.c_proj.weight
    layers.i.mlp.fc.weight [4h, h]         -> transformer.h.i.mlp.c_fc.weight [h, 4h]
    layers.i.mlp.proj.weight [h, 4h]       -> transformer.h.i.mlp.c_proj.weight [4h, h]
    final_ln                               -> transformer.ln_f

Same math: pre-LN, GELU as ``model.activation`` (exact erf ``"gelu"`` or tanh ``"gelu_new"``), LayerNorm eps from the config,
scale 1/sqrt(head_dim), learned positions, tied output layer without bias.
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
from training.parallel.sharding import resize_vocab_rows
from training.runtime.run_lock import lock_existing_output, overlapping_input
from training.tools.hf_interop import gpt2_layer_names, require_transformers
from training.tools.hf_tokenizer import TokenizerExportError, save_hf_tokenizer

logger = logging.getLogger(__name__)


class ExportError(SuiteError):
    """Bad export input (one line)."""


def hf_config(model_cfg, vocab_size: int, eod: int | None):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=model_cfg.positions,
        n_embd=model_cfg.hidden_size,
        n_layer=model_cfg.num_layers,
        n_head=model_cfg.num_attention_heads,
        n_inner=model_cfg.ffn_size,
        activation_function="gelu_new" if getattr(model_cfg, "activation", "gelu") == "gelu_new" else "gelu",
        layer_norm_epsilon=model_cfg.layernorm_epsilon,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        initializer_range=model_cfg.init_method_std,
        scale_attn_weights=True,
        tie_word_embeddings=True,
        bos_token_id=eod if eod is not None else 0,
        eos_token_id=eod if eod is not None else 0,
        architectures=["GPT2LMHeadModel"],
    )


def to_hf_state_dict(sd: dict[str, torch.Tensor], num_layers: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our merged (TP=1) GPT-2 state dict -> HF ``GPT2LMHeadModel`` names (padding rows dropped)."""
    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise ExportError(f"checkpoint state dict lacks {name!r}: not a GPT-2 model of this project")
        return sd[name].detach().to(torch.float32).cpu()

    wte = get("embedding.word_embeddings.weight")
    if wte.size(0) < vocab_size:
        raise ExportError(f"embedding has {wte.size(0)} rows but the vocabulary has {vocab_size} ids")
    out = {"transformer.wte.weight": resize_vocab_rows(wte, vocab_size).clone(),
           "transformer.wpe.weight": get("embedding.position_embeddings.weight")}
    for ours, theirs, transpose in gpt2_layer_names(num_layers):
        out[theirs] = get(ours).t().contiguous() if transpose else get(ours)
    return out


def build_hf_model(sd: dict[str, torch.Tensor], model_cfg, vocab_size: int, eod: int | None):
    """A ``GPT2LMHeadModel`` holding our weights (strict load: every HF weight must be provided)."""
    from transformers import GPT2LMHeadModel

    if model_cfg.arch == "bert":
        raise ExportError(f"only GPT-2 checkpoints can be exported to GPT2LMHeadModel, this one is {model_cfg.arch!r}")
    model = GPT2LMHeadModel(hf_config(model_cfg, vocab_size, eod))
    hf_sd = to_hf_state_dict(sd, model_cfg.num_layers, vocab_size)
    missing, unexpected = model.load_state_dict(hf_sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight" and not m.endswith(".attn.bias") and not m.endswith("masked_bias")]
    if missing or unexpected:
        raise ExportError(f"weight mapping mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    return model.eval()


def _save_tokenizer(tokenizer, out: Path, max_len: int) -> None:
    """tokenizer.json + configs for AutoTokenizer (GPT-2 BPE or SentencePiece BPE, ids checked equal to ours)."""
    try:
        save_hf_tokenizer(tokenizer, out, max_len)
    except TokenizerExportError as e:
        raise ExportError(str(e)) from None
    if getattr(tokenizer, "kind", None) == "gpt2_bpe":
        for name in ("vocab.json", "merges.txt"):  # the plain files, for tools that read them directly
            if not (out / name).exists():
                shutil.copy(tokenizer.vocab_file if name == "vocab.json" else tokenizer.merges_file, out / name)
    if getattr(tokenizer, "kind", None) == "wordpiece" and not (out / "vocab.txt").exists():
        # transformers 5 saves tokenizer.json only; BERT tools (Megatron's tokenizer, the slow BertTokenizer) read vocab.txt
        shutil.copy(tokenizer.vocab_file, out / "vocab.txt")


def export(run_dir: str | Path, out: str | Path, overwrite: bool = False, with_tokenizer: bool = True) -> Path:
    """Write the HF folder to a temporary sibling, then rename it into place. Refused before any work: an
    ``out`` that is, holds or lies inside the checkpoint's run directory, and an ``out`` held by a live run
    (its run lock is taken while the export replaces it)."""
    out = Path(out)
    if not Path(run_dir).is_dir():
        raise ExportError(f"checkpoint directory {run_dir} does not exist")
    overlap = overlapping_input(out, {"--checkpoint": run_dir})
    if overlap:
        raise ExportError(f"--out {out} {overlap}: the export would replace the run it reads; choose an --out "
                          f"outside it")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    lock = lock_existing_output(out)
    try:
        return _export(Path(run_dir), out, with_tokenizer)
    finally:
        if lock is not None:
            lock.release()


def _export(run_dir: Path, out: Path, with_tokenizer: bool) -> Path:
    require_transformers()  # one line naming the `hf` extra when transformers is missing
    from megatron_ds_suite.core.tokenizer import load_tokenizer
    from training.checkpoint_reader import load_merged_state_dict

    sd, cfg, meta = load_merged_state_dict(run_dir)
    tokenizer = load_tokenizer(meta["tokenizer"], base_dir=Path(run_dir))
    vocab = tokenizer.vocab_size
    if cfg.model.vocab_size is not None and cfg.model.vocab_size != vocab:
        raise ExportError(f"checkpoint vocabulary ({cfg.model.vocab_size}) does not match its tokenizer ({vocab})")
    if cfg.model.arch == "bert":  # Megatron-BERT (pre_ln) / BERT (post_ln), training.tools.hf_bert
        from training.tools.hf_bert import BertMappingError, build_hf_bert

        try:
            model = build_hf_bert(sd, cfg.model, vocab)
        except BertMappingError as e:
            raise ExportError(str(e)) from None
    elif cfg.model.llama_options() or cfg.model.activation == "swiglu":  # training.tools.hf_llama
        from training.tools.hf_llama import LlamaMappingError, build_hf_llama

        try:
            model = build_hf_llama(sd, cfg.model, vocab, getattr(tokenizer, "eod", None))
        except LlamaMappingError as e:
            raise ExportError(f"{e}: only GPT-2 and Llama-shaped models export to transformers") from None
    else:
        model = build_hf_model(sd, cfg.model, vocab, getattr(tokenizer, "eod", None))
    with atomic.atomic_dir(out) as tmp:  # a failed export leaves the previous folder (or none)
        model.save_pretrained(str(tmp), safe_serialization=True)
        if with_tokenizer:
            _save_tokenizer(tokenizer, tmp, cfg.model.positions)
    logger.info("exported %s -> %s (%d layers, hidden %d, vocab %d)", run_dir, out, cfg.model.num_layers,
                cfg.model.hidden_size, vocab)
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog=program("python -m training.tools.export_hf"), description="Export a GPT-2, Llama-shaped GPT or BERT checkpoint to transformers")
    ap.add_argument("--checkpoint", required=True, help="run directory")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--no-tokenizer", action="store_true",
                    help="write the model only (for a tokenizer that has no identical HF form, e.g. SentencePiece BERT)")
    args = ap.parse_args(argv)
    try:
        export(args.checkpoint, args.out, args.overwrite, with_tokenizer=not args.no_tokenizer)
    except ValueError as e:  # ExportError, ConfigError, TokenizerError: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
