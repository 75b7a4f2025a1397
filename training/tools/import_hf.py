"""Import a Hugging Face ``transformers`` GPT-2, Llama or BERT into a run directory of this project, at any TP/PP.

    python -m training.tools.import_hf --model DIR_OR_NAME --out RUN_DIR [--tp K] [--pp P] [--seq-length S]

``--model`` is a folder written by ``save_pretrained`` (``config.json``, ``model.safetensors`` or
``pytorch_model.bin``, and the tokenizer: ``vocab.json`` + ``merges.txt`` or ``tokenizer.json``), or a
hub name (``gpt2``), which needs the network or a filled Hugging Face cache; offline it fails with one
line saying how to get the folder. Model classes: ``GPT2LMHeadModel``; ``MegatronBertForPreTraining``
(-> ``model.layer_order: pre_ln``) and ``BertForPreTraining`` (-> ``post_ln``) with a WordPiece
``vocab.txt`` (-> tokenizer kind ``wordpiece``) or ``tokenizer.json`` (-> ``hf``); BERT's name map is
:mod:`training.tools.hf_bert`. BERT's ``--pp`` layout is :mod:`training.models.bert_pipe`'s. ``LlamaForCausalLM`` (plain RoPE; its
tokenizer from ``tokenizer.json`` -> ``hf``) becomes a GPT with the Llama options; its name map is
:mod:`training.tools.hf_llama`; ``MistralForCausalLM`` (without a sliding window shorter than its positions) and
``Qwen2ForCausalLM`` (q/k/v bias) share it.

The output is a checkpoint in the layout training writes (``checkpoints/iter_0000000/mp_rank_XX_...``,
the pipeline's ``layer_XX-model_YY-...`` files when ``--pp`` > 1, ``checkpoints/latest``) holding the
weights split for TP=K x PP=P, the vocabulary padded by our rule (a multiple of
``make_vocab_size_divisible_by`` x K, zero rows), the tokenizer files under ``RUN_DIR/tokenizer`` and a
model config that reproduces the source exactly (``model.activation: gelu_new`` for GPT-2's tanh
GeLU, LayerNorm eps, positions, MLP width). It holds weights only (no optimizer, schedule or RNG):

    python -m evaluation generate --checkpoint RUN_DIR --prompt "..."         # sample from it
    python -m evaluation lambada --checkpoint RUN_DIR --data ...              # score it
    python -m training.pretrain --config X.yaml train.init_from=RUN_DIR ...   # train on from it
    python -m training.tools.export_hf --checkpoint RUN_DIR --out DIR               # and back (== the source)

The weights are read from the folder's files and checked against the model ``config.json`` builds
(:mod:`training.tools.hf_weights`; ``from_pretrained`` would fill a missing tensor with random values): a missing,
unexpected or other-shaped tensor, a shard index that omits tensors, NaN/Inf values and bad ``config.json`` values
are refused in one line naming them, before anything is written; :func:`write_checkpoint` checks every import
against our model once more (:mod:`training.tools.tensor_check`). The run records the tokenizer's identity
(``vocab_size``, ``eod``, the files' sha256), so a tokenizer swapped afterwards is refused where the run is read.

Name/layout mapping (inverse of :mod:`training.tools.export_hf`; HF ``Conv1D`` stores ``[in, out]``):

    transformer.wte.weight [V, h]               -> embedding.word_embeddings.weight [V_padded, h]
    transformer.wpe.weight                      -> embedding.position_embeddings.weight
    transformer.h.i.ln_1 / ln_2                 -> layers.i.ln1 / ln2
    transformer.h.i.attn.c_attn.weight [h, 3h]  -> layers.i.attn.qkv.weight [3h, h] (rows [Q;K;V])
    transformer.h.i.attn.c_proj / mlp.c_fc / mlp.c_proj -> layers.i.attn.proj / mlp.fc / mlp.proj (transposed)
    transformer.ln_f                            -> final_ln
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch

from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.program import prog as program
from megatron_ds_suite.core.program import stderr_is_terminal
from training import checkpoint_catalog as catalog
from training.checkpoint import partition_tags as tags_of
from training.config import Config, validate_static
from training.models.config import ModelConfig, padded_vocab_size
from training.parallel.sharding import is_vocab_sized, resize_vocab_rows, shard_tagged
from training.runtime.run_lock import lock_existing_output, overlapping_input
from training.tools.hf_bert import from_hf as bert_from_hf
from training.tools.hf_bert import model_config_from_hf as bert_config_from_hf
from training.tools.hf_interop import ImportHFError, check_config, gpt2_layer_names, require_transformers
from training.tools.hf_llama import LLAMA_FAMILY
from training.tools.hf_llama import from_hf as llama_from_hf
from training.tools.hf_llama import model_config_from_hf as llama_config_from_hf
from training.tools.hf_weights import read_checked
from training.tools.tensor_check import check_shapes, check_values, model_shapes

logger = logging.getLogger(__name__)

TAG = "iter_0000000"
# transformers' activation names -> model.activation (both tanh approximations are the same function)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new"}


# --------------------------------------------------------------------------------------------------
# Source folder
# --------------------------------------------------------------------------------------------------
def resolve_model_dir(model: str) -> Path:
    """A local folder as is; otherwise a hub name through the Hugging Face cache/network."""
    p = Path(model)
    if p.is_dir():
        return p
    if p.exists():
        raise ImportHFError(f"--model {model} is a file; pass the folder that holds config.json and the weights")
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ImportHFError(f"--model {model}: no such folder")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.txt", "*.safetensors"]
        folder = Path(snapshot_download(model, allow_patterns=patterns))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(model, allow_patterns=[*patterns, "pytorch_model*.bin"]))
        return folder
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated repo: all one line
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise ImportHFError(f"--model {model} is not a local folder and the Hugging Face hub could not provide it "
                            f"({type(e).__name__}: {reason}); download it where there is network, e.g. "
                            f"`huggingface-cli download {model} --local-dir DIR`, and pass --model DIR") from None


def model_config_from_hf(hf_cfg, seq_length: int | None = None) -> ModelConfig:
    """Our ModelConfig for a ``GPT2Config``; refuses options our GPT-2 does not compute."""
    if getattr(hf_cfg, "model_type", None) != "gpt2":
        raise ImportHFError(f"model_type {getattr(hf_cfg, 'model_type', None)!r} is not supported: only GPT-2 "
                            f"(GPT2LMHeadModel) folders can be imported")
    check_config(hf_cfg, counts=("n_layer", "n_embd", "n_head", "n_positions", "vocab_size"), optional_counts=("n_inner",),
                 probabilities=("resid_pdrop", "attn_pdrop"), positives=("layer_norm_epsilon", "initializer_range"))
    act = ACTIVATIONS.get(hf_cfg.activation_function) if isinstance(hf_cfg.activation_function, str) else None
    unsupported = []
    if act is None:
        unsupported.append(f"activation_function={hf_cfg.activation_function!r}")
    if not getattr(hf_cfg, "scale_attn_weights", True):
        unsupported.append("scale_attn_weights=False")
    if getattr(hf_cfg, "scale_attn_by_inverse_layer_idx", False):
        unsupported.append("scale_attn_by_inverse_layer_idx=True")
    if getattr(hf_cfg, "add_cross_attention", False):
        unsupported.append("add_cross_attention=True")
    if not getattr(hf_cfg, "tie_word_embeddings", True):
        unsupported.append("tie_word_embeddings=False")
    if unsupported:
        raise ImportHFError(f"the GPT-2 config sets {', '.join(unsupported)}, which this project's GPT-2 does not "
                            f"compute; only standard GPT-2 configs import exactly")
    positions = hf_cfg.n_positions
    seq = seq_length or positions
    if seq > positions:
        raise ImportHFError(f"--seq-length {seq} exceeds the model's n_positions {positions}")
    return ModelConfig(arch="gpt2", num_layers=hf_cfg.n_layer, hidden_size=hf_cfg.n_embd,
                       num_attention_heads=hf_cfg.n_head, seq_length=seq, max_position_embeddings=positions,
                       vocab_size=hf_cfg.vocab_size, ffn_hidden_size=hf_cfg.n_inner or 4 * hf_cfg.n_embd,
                       hidden_dropout=float(hf_cfg.resid_pdrop), attention_dropout=float(hf_cfg.attn_pdrop),
                       init_method_std=float(hf_cfg.initializer_range),
                       layernorm_epsilon=float(hf_cfg.layer_norm_epsilon), activation=act)


def from_hf_state_dict(hf: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """``GPT2LMHeadModel`` state dict -> our TP=1 GPTModel names (vocabulary not padded yet)."""
    def get(name: str) -> torch.Tensor:
        for key in (name, name[len("transformer."):]):  # GPT2Model folders lack the prefix
            if key in hf:
                return hf[key].detach().to(torch.float32).cpu().contiguous()
        raise ImportHFError(f"the source weights lack {name!r}: not a GPT-2 checkpoint")

    wte = get("transformer.wte.weight")
    head = hf.get("lm_head.weight")
    if head is not None and not torch.equal(head.detach().float().cpu(), wte):
        raise ImportHFError("lm_head.weight differs from transformer.wte.weight: an untied output layer cannot be "
                            "imported (our GPT-2 ties them)")
    out = {"embedding.word_embeddings.weight": wte,
           "embedding.position_embeddings.weight": get("transformer.wpe.weight")}
    for ours, theirs, transpose in gpt2_layer_names(num_layers):
        out[ours] = get(theirs).t().contiguous() if transpose else get(theirs)
    return out


#: ``model_type`` -> the transformers class whose folders import
HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "megatron-bert": "MegatronBertForPreTraining", "bert": "BertForPreTraining",
              **LLAMA_FAMILY}


def load_source(folder: Path, hf_cfg) -> dict[str, torch.Tensor]:
    """The source's tensors {transformers name: tensor}, read from its files and checked against the model its
    config builds (:mod:`training.tools.hf_weights`: nothing missing, unexpected or of another shape, all finite)."""
    transformers = require_transformers()
    return read_checked(folder, getattr(transformers, HF_CLASSES[hf_cfg.model_type]), hf_cfg)


def bpe_files_from_tokenizer_json(path: Path, dest: Path) -> None:
    """``vocab.json`` + ``merges.txt`` in ``dest`` from a byte-level BPE ``tokenizer.json`` (what
    ``save_pretrained`` of a GPT-2 tokenizer writes under transformers 5: no vocab/merges files), read as JSON
    (both merge layouts: ``"a b"`` strings and ``["a", "b"]`` pairs). Anything else is one ImportHFError line."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ImportHFError(f"{path} is not a readable tokenizer.json ({e})") from None
    model = spec.get("model") if isinstance(spec, dict) else None
    pre = spec.get("pre_tokenizer") if isinstance(spec, dict) else None
    byte_level = isinstance(pre, dict) and (pre.get("type") == "ByteLevel" or any(
        isinstance(p, dict) and p.get("type") == "ByteLevel" for p in pre.get("pretokenizers") or []))
    if not isinstance(model, dict) or model.get("type") != "BPE" or not byte_level:
        kind = model.get("type") if isinstance(model, dict) else "unknown"
        raise ImportHFError(f"{path} is a {kind} tokenizer, not GPT-2's byte-level BPE: a GPT-2 model needs "
                            f"vocab.json + merges.txt or a byte-level BPE tokenizer.json")
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        raise ImportHFError(f"{path}: its BPE model has no vocab/merges tables")
    lines = [m if isinstance(m, str) else " ".join(m) for m in merges]
    (dest / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (dest / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in lines), encoding="utf-8")


def import_tokenizer(folder: Path, dest: Path, model_type: str):
    """Copy the source's tokenizer files into ``dest`` and return (our tokenizer, spec relative to the run
    directory, with its identity: ``vocab_size``, ``eod`` and the files' ``sha256``, as training records it, so
    a tokenizer file swapped later is refused by whatever loads the run), after checking that its ids equal
    ``AutoTokenizer``'s on a probe text.

    GPT-2: ``vocab.json`` + ``merges.txt`` (written from ``tokenizer.json`` when only that exists) ->
    ``gpt2_bpe``. BERT: ``vocab.txt`` -> ``wordpiece`` (lower-casing from ``tokenizer_config.json``'s
    ``do_lower_case``), else ``tokenizer.json`` -> ``hf``.
    """
    from transformers import AutoTokenizer

    from megatron_ds_suite.core.tokenizer import load_tokenizer

    dest.mkdir(parents=True, exist_ok=True)
    has = {n: (folder / n).is_file() for n in ("vocab.json", "merges.txt", "vocab.txt", "tokenizer.json")}
    if model_type == "gpt2" and has["vocab.json"] and has["merges.txt"]:
        shutil.copyfile(folder / "vocab.json", dest / "vocab.json")
        shutil.copyfile(folder / "merges.txt", dest / "merges.txt")
        spec = {"kind": "gpt2_bpe", "vocab_file": "tokenizer/vocab.json", "merges_file": "tokenizer/merges.txt"}
    elif model_type == "gpt2" and has["tokenizer.json"]:
        bpe_files_from_tokenizer_json(folder / "tokenizer.json", dest)
        spec = {"kind": "gpt2_bpe", "vocab_file": "tokenizer/vocab.json", "merges_file": "tokenizer/merges.txt"}
    elif model_type != "gpt2" and has["vocab.txt"]:
        tc = folder / "tokenizer_config.json"
        lower = json.loads(tc.read_text(encoding="utf-8")).get("do_lower_case", True) if tc.is_file() else True
        shutil.copyfile(folder / "vocab.txt", dest / "vocab.txt")
        spec = {"kind": "wordpiece", "vocab_file": "tokenizer/vocab.txt", "lowercase": bool(lower)}
    elif model_type != "gpt2" and has["tokenizer.json"]:
        shutil.copyfile(folder / "tokenizer.json", dest / "tokenizer.json")
        spec = {"kind": "hf", "tokenizer_file": "tokenizer/tokenizer.json"}
    else:
        want = "vocab.json + merges.txt or tokenizer.json" if model_type == "gpt2" else "vocab.txt or tokenizer.json"
        raise ImportHFError(f"{folder} has no tokenizer ({want}): copy the model's tokenizer files into it")
    tok = load_tokenizer(spec, base_dir=dest.parent)
    spec = {**tok.spec(), **spec}  # its identity as training records it: vocab_size, eod, the files' sha256
    try:
        theirs = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError):
        theirs = None
    probe = "Hello world, it's 2024!\n  Ünïcödé\ttabs and spaces."
    if theirs is not None and theirs(probe, add_special_tokens=False)["input_ids"] != tok.encode(probe):
        raise ImportHFError(f"the tokenizer of {folder} does not give the same ids as this project's {spec['kind']} "
                            f"tokenizer on a probe text")
    return tok, spec


# --------------------------------------------------------------------------------------------------
# Writing the checkpoint
# --------------------------------------------------------------------------------------------------
def partition_tags(model_cfg: ModelConfig) -> dict[str, tuple[int, int] | None]:
    """{parameter name: (partition_dim, stride) or None}, read from a small model of the same
    structure (the tags depend on the module types, not on the sizes)."""
    from training.models.bert import BertModel
    from training.models.gpt2 import GPTModel

    # head size 2 and the whole head rotated keep RoPE valid; no parameter depends on either
    probe = replace(model_cfg, hidden_size=2 * model_cfg.num_attention_heads, ffn_hidden_size=8, seq_length=2,
                    max_position_embeddings=2, vocab_size=8, rotary_percent=1.0)
    return tags_of((BertModel if model_cfg.arch == "bert" else GPTModel)(probe, 8, None, seed=0))


def shard(full: torch.Tensor, tag: tuple[int, int] | None, rank: int, world: int) -> torch.Tensor:
    """This rank's own copy of its shard of ``full`` (``tag``: the parameter's partition tag)."""
    return shard_tagged(full, tag, rank, world).clone()


def pipe_locator(m: ModelConfig):
    """``name -> (pipeline layer index, name in that layer's file)`` for the PP=1 parameter names of ``m``."""
    if m.arch == "bert":
        from training.models.bert_pipe import pipe_location

        return lambda name: pipe_location(name, m.num_layers)
    from training.models.gpt2_pipe import pipe_layer_names

    prefixes = pipe_layer_names(m.num_layers, m.untie_embeddings_and_output_weights)

    def locate(name: str) -> tuple[int, str]:
        idx, prefix = next((i, p) for i, p in prefixes.items() if name.startswith(p))
        return idx, name[len(prefix):]

    return locate


def write_checkpoint(out: Path, cfg: Config, weights: dict[str, torch.Tensor], tokenizer_spec: dict,
                     source: str) -> None:
    """Files of a TP x PP checkpoint at iteration 0 in the layout ``training.checkpoint`` reads.

    PP = 1: ``mp_rank_{tp:02d}_model_states.pt`` with the rank's ``module`` state dict. PP > 1 (DeepSpeed
    PipelineModule layout): ``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` per pipeline layer
    (0 embedding, 1..L transformer layers, L+1 final LayerNorm (BERT: the heads); the tied output layer L+2 is
    the embedding again and has no file) and one ``mp_rank_{pp*TP+tp:02d}`` metadata file per stage and TP
    rank (DeepSpeed's model-parallel rank with DP = 1).
    """
    tp, pp, m = cfg.parallel.tensor, cfg.parallel.pipeline, cfg.model
    padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    # the last guard of every import (HF, Megatron-LM): our model's names and shapes, finite values, before writing
    check_shapes({k: v.shape for k, v in weights.items()}, model_shapes(m, m.vocab_size), source,
                 "the imported tensors do not make this model (a mapping or config mismatch)")
    check_values(weights, source)
    tags = partition_tags(m)
    weights = {k: (resize_vocab_rows(v, padded) if is_vocab_sized(k) else v) for k, v in weights.items()}
    folder = out / "checkpoints" / TAG
    folder.mkdir(parents=True)
    meta = {"config": cfg.to_dict(), "iteration": 0, "consumed_samples": 0, "padded_vocab_size": padded,
            "tokenizer": tokenizer_spec, "partition": tags, "parallel": {"tp": tp, "pp": pp, "dp": 1},
            "optimizer_param_names": None, "rng": None, "dtype": "fp32", "imported_from": source,
            "weights_only": True}
    from tqdm import tqdm

    locate = pipe_locator(m)
    # a bar only on a terminal (not redrawn into a piped or Slurm log)
    for r in tqdm(range(tp), desc="write TP shards", unit="rank", disable=tp == 1 or not stderr_is_terminal(),
                  leave=False):
        local = {name: shard(w, tags[name], r, tp) for name, w in weights.items()}
        if pp == 1:
            torch.save({"module": local, **meta, "tp_rank": r, "pp_rank": 0}, folder / f"mp_rank_{r:02d}_model_states.pt")
            continue
        layers: dict[int, dict[str, torch.Tensor]] = {}
        for name, v in local.items():
            idx, key = locate(name)
            layers.setdefault(idx, {})[key] = v
        for idx, layer in sorted(layers.items()):
            torch.save(layer, folder / f"layer_{idx:02d}-model_{r:02d}-model_states.pt")
        for s in range(pp):
            torch.save({"module": None, **meta, "tp_rank": r, "pp_rank": s},
                       folder / f"mp_rank_{s * tp + r:02d}_model_states.pt")
    catalog.sync_folder(folder)  # durable, then recorded complete (training.checkpoint_catalog), then `latest`
    catalog.write_record(folder, TAG, 0)
    (out / "checkpoints" / "latest").write_text(TAG)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))


def import_hf(model: str, out: str | Path, tp: int = 1, pp: int = 1, seq_length: int | None = None,
              overwrite: bool = False) -> Path:
    """Import ``model`` (folder or hub name) into run directory ``out``; written to a temporary sibling
    and renamed into place, so a failure leaves nothing half-written. Refused before any work: an ``out``
    that is, holds or lies inside the model folder, and an ``out`` held by a live training run (its run
    lock is taken while the import replaces it, so no run can start there meanwhile either)."""
    out = Path(out)
    if Path(model).exists():
        _refuse_overlap(out, model)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ImportHFError(f"--out {out} exists and is not empty (choose a new run directory or pass --overwrite)")
    if tp < 1 or pp < 1:
        raise ImportHFError(f"--tp and --pp must be >= 1, got {tp} and {pp}")
    lock = lock_existing_output(out)
    try:
        return _import(model, out, tp, pp, seq_length)
    finally:
        if lock is not None:
            lock.release()


def _refuse_overlap(out: Path, model: str | Path) -> None:
    overlap = overlapping_input(out, {"--model": model})
    if overlap:
        raise ImportHFError(f"--out {out} {overlap}: the import would replace the model it reads; choose an --out "
                            f"outside it")


def _import(model: str, out: Path, tp: int, pp: int, seq_length: int | None) -> Path:
    require_transformers()
    folder = resolve_model_dir(model)
    _refuse_overlap(out, folder)  # a hub name resolved to a cache folder
    from transformers import AutoConfig

    try:
        hf_cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - unreadable JSON, a value of the wrong type (transformers 5 validates): one line
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise ImportHFError(f"{folder}: no readable config.json ({reason}): fix config.json or save the model "
                            f"again") from None
    model_type = getattr(hf_cfg, "model_type", None)
    if model_type == "gpt2":
        model_cfg = model_config_from_hf(hf_cfg, seq_length)
    elif model_type in ("megatron-bert", "bert"):
        model_cfg = bert_config_from_hf(hf_cfg, seq_length)
    elif model_type in LLAMA_FAMILY:
        model_cfg = llama_config_from_hf(hf_cfg, seq_length)
    else:
        raise ImportHFError(f"model_type {model_type!r} is not supported: GPT-2 (GPT2LMHeadModel), Llama "
                            f"(LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM), Megatron-BERT (MegatronBertForPreTraining) or BERT "
                            f"(BertForPreTraining) folders import")
    cfg = Config(model=model_cfg)
    cfg.parallel.tensor, cfg.parallel.pipeline = tp, pp
    cfg.run.dir = str(out)
    validate_static(cfg)  # TP divides heads and MLP width, PP <= layers, PP only for GPT-2 (before reading weights)
    hf_sd = load_source(folder, hf_cfg)
    if model_type == "gpt2":
        weights = from_hf_state_dict(hf_sd, cfg.model.num_layers)
    elif model_type in LLAMA_FAMILY:
        weights = llama_from_hf(hf_sd, cfg.model)
    else:
        weights = bert_from_hf(hf_sd, cfg.model)
    with atomic.atomic_dir(out) as tmp:  # a failed import leaves the previous folder (or none)
        tok, spec = import_tokenizer(folder, tmp / "tokenizer", model_type)
        if tok.vocab_size != cfg.model.vocab_size:
            raise ImportHFError(f"the tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                                f"{cfg.model.vocab_size}")
        write_checkpoint(tmp, cfg, weights, spec, str(model))
    logger.info("imported %s -> %s (TP=%d PP=%d, %d layers, hidden %d, vocab %d padded to %d)", model, out, tp, pp,
                cfg.model.num_layers, cfg.model.hidden_size, cfg.model.vocab_size,
                padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, tp))
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog=program("python -m training.tools.import_hf"), description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True,
                    help="transformers GPT-2, Llama or BERT folder, or a hub name (needs network/cache)")
    ap.add_argument("--out", required=True, help="new run directory")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the written checkpoint")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree of the written checkpoint")
    ap.add_argument("--seq-length", type=int, default=None, help="model.seq_length (default: n_positions)")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = ap.parse_args(argv)
    try:
        import_hf(args.model, args.out, args.tp, args.pp, args.seq_length, args.overwrite)
    except ValueError as e:  # ImportHFError, ConfigError, BertMappingError, TokenizerError: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
