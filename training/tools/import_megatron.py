"""Import a Megatron-LM GPT-2 or BERT checkpoint (the legacy ``language_model`` layout) into a run directory, at any TP/PP.

    python -m training.tools.import_megatron --checkpoint DIR --out RUN_DIR [--tp K] [--pp P] \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt      # GPT-2 (byte-level BPE)
        --vocab-file bert-vocab.txt [--tokenizer-type BertWordPieceCase] # BERT (WordPiece)

``DIR`` is what Megatron-LM's ``--save`` wrote (``latest_checkpointed_iteration.txt`` naming an iteration or
``release``, ``iter_XXXXXXX/`` or ``release/`` folders), or one such folder. Each holds one
``mp_rank_XX/model_optim_rng.pt`` per tensor-parallel rank (``mp_rank_XX_YYY`` with pipeline stage YYY): any
source TP x PP is merged, then written at ``--tp`` x ``--pp`` in the layout training reads, with the same
machinery as :mod:`training.tools.import_hf` (run lock, refusal of a non-empty ``--out``, tokenizer identity).
Weights only: the optimizer, schedule and RNG states in the files are not carried over.

The files are pickles. They are loaded with ``torch.load(weights_only=True)`` and an allow-list of what
Megatron stores besides tensors: its ``args`` (``argparse.Namespace``), numpy arrays (RNG states) and
the enums in ``args`` (:data:`MEGATRON_ENUMS`, read as plain strings; Megatron need not be installed).
A file that asks for anything else is refused in one line, before any weight is used.
Each file is then walked once, iteratively and bounded (:mod:`training.tools.untrusted_tree`: depth, entries,
shared sub-structures visited once, cycles refused), so a small crafted file can neither hang the import nor end it
in a ``RecursionError``.

The rank files must make one checkpoint: as many as the TP x PP of the checkpoint's own args (a missing one is
named), all of the same iteration, checkpoint_version and args (but ``rank``), the TP ranks of a stage with the same
tensor names and shapes and equal copies of the replicated tensors. The args read are type-checked
(:data:`INT_ARGS`, :data:`FLOAT_ARGS`, :data:`BOOL_ARGS`), and the merged weights are checked against our model
(names, shapes, finite values) before anything is written.

Names (``language_model.embedding`` / ``.encoder``, called ``.transformer`` before 2021; attention
``self_attention`` or ``attention``; norms ``*_layernorm`` or ``*_norm``):

    embedding.word_embeddings.weight [V_pad/t, h] per rank  -> embedding.word_embeddings.weight (rows, re-padded)
    embedding.position_embeddings / tokentype_embeddings    -> the same names
    layers.i.input_layernorm / post_attention_layernorm     -> layers.i.ln1 / ln2
    layers.i.*attention.query_key_value [3h/t, h]           -> layers.i.attn.qkv (rows [Q; K; V], see below)
    layers.i.*attention.dense [h, h/t]                      -> layers.i.attn.proj (input columns)
    layers.i.mlp.dense_h_to_4h [f/t, h] / dense_4h_to_h     -> layers.i.mlp.fc (rows) / mlp.proj (columns)
    final_layernorm                                         -> final_ln
    BERT: lm_head.dense / lm_head.layernorm / lm_head.bias [V_pad/t] -> lm_head.dense / lm_head.ln / lm_head.bias;
          language_model.pooler.dense -> pooler; binary_head -> binary_head

Layer i of pipeline stage s is global layer (layers of stages < s) + i. The tied output copy
``word_embeddings_for_head`` of the last stage is not read (it equals the embedding).

QKV row order within one TP rank's shard (np heads on that rank, hn head size), by the file's
``checkpoint_version`` (Megatron's ``fix_query_key_value_ordering`` reads the old orders the same way):

    absent (0)  [3, np, hn]   all queries, then all keys, then all values
    1.0         [np, hn, 3]   q, k, v interleaved row by row
    2.0, 3.0    [np, 3, hn]   per head its q rows, k rows, v rows

The model config comes from the file's ``args`` (num_layers, hidden_size, num_attention_heads,
max_position_embeddings, make_vocab_size_divisible_by, layernorm_epsilon, the GeLU flavour, query-key layer
scaling); shapes are checked against the tensors. Files without ``args`` (the oldest releases) need
``--num-attention-heads``. What our model cannot compute (rotary positions, RMSNorm, SwiGLU, grouped-query
attention, untied output, post-LayerNorm residuals, virtual pipeline chunks, ...) is refused in one line.

GeLU: Megatron's MLP uses the fused bias-GeLU kernel (tanh approximation) when ``bias_gelu_fusion`` is on
(its default) and ``openai_gelu`` is off, else the exact erf GeLU; BERT's LM head always uses the exact one
unless ``openai_gelu`` -> ``model.activation`` and ``model.lm_head_activation``.

Megatron checkpoints carry no vocabulary: ``--vocab-file``/``--merge-file`` as in Megatron's own command
line. The vocabulary size Megatron padded (``make_vocab_size_divisible_by`` x source TP) must match the
embedding rows, which catches a wrong vocabulary file.
"""
from __future__ import annotations

import argparse
import enum
import logging
import math
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.errors import SuiteError
from megatron_ds_suite.core.program import prog as program
from training import safe_load
from training.config import Config, validate_static
from training.models.config import ModelConfig, padded_vocab_size
from training.runtime.run_lock import lock_existing_output, overlapping_input
from training.tools.import_hf import write_checkpoint
from training.tools.tensor_check import few
from training.tools.untrusted_tree import leaves, path_name, shown

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"

#: Enums found in the ``args`` of Megatron's checkpoints (``args.model_type`` since 2022, ``args.attention_backend``
#: since 2024, ``args.exit_signal`` = ``signal.SIGTERM``, the position-embedding type of Megatron-DeepSpeed) and in
#: the rerun state machine's state; each is read as the string ``"Name(value)"`` by :func:`_enum_stand_in`.
MEGATRON_ENUMS = (
    "signal.Signals",
    "megatron.model.enums.ModelType",
    "megatron.model.enums.PositionEmbeddingType",
    "megatron.legacy.model.enums.ModelType",
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
)

TOKENIZERS = ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase")


class ImportMegatronError(SuiteError):
    """A Megatron checkpoint that cannot be imported (one line: what, why, what to do)."""


# --------------------------------------------------------------------------------------------------
# Reading the files
# --------------------------------------------------------------------------------------------------
def _enum_stand_in(qualname: str):
    """A callable the restricted unpickler may call in place of Megatron enum ``qualname``: enum members
    pickle as ``Enum(value)``, so this returns ``"Name(value)"`` without importing Megatron."""
    name = qualname.rsplit(".", 1)[1]

    def stand_in(value):
        return f"{name}({value!r})"

    stand_in.__qualname__ = stand_in.__name__ = name
    return stand_in


def allowed_globals() -> list:
    """What a Megatron checkpoint may ask the unpickler for besides tensors and containers."""
    return [argparse.Namespace, *[(_enum_stand_in(q), q) for q in MEGATRON_ENUMS]]


@dataclass
class RankFile:
    """One loaded ``model_optim_rng.pt``: its model tensors by dotted name, its ``args`` and what every rank file of
    one checkpoint shares (iteration, checkpoint_version, the args apart from the process's own rank)."""

    path: Path
    model: dict[str, torch.Tensor]
    args: argparse.Namespace | None
    shared_args: dict[str, tuple]
    iteration: object
    version: float


RANK_ARGS = ("rank", "local_rank")  # the only args that differ between the rank files of one checkpoint


def _leaf_key(value) -> tuple:
    """A comparable stand-in for an args leaf (floats by repr so NaN equals NaN; tensors by shape and dtype; an enum
    member as the string :func:`_enum_stand_in` reads it as, which torch's unpickler may give instead)."""
    if isinstance(value, enum.Enum):
        return ("str", f"{type(value).__name__}({value.value!r})")
    if isinstance(value, float):
        return ("float", repr(value))
    if value is None or isinstance(value, (bool, int, str)):
        return (type(value).__name__, value)
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), str(value.dtype))
    return (type(value).__name__,)


def load_file(path: Path) -> RankFile:
    """One ``model_optim_rng.pt``, loaded without running code (:func:`training.safe_load.load` with
    :func:`allowed_globals`; anything else it asks for is refused in one line) and walked once, iteratively and
    bounded (:func:`training.tools.untrusted_tree.leaves`: too deep, too many entries, a cycle: one line)."""
    with torch.serialization.safe_globals(allowed_globals()):
        state = safe_load.load(path)
    if not isinstance(state, dict):
        raise ImportMegatronError(f"{path} holds a {type(state).__name__}, not a Megatron checkpoint dict")
    found = leaves(state, str(path))
    if "model" not in state:
        keys = ", ".join(sorted(k for k in state if isinstance(k, str))[:6])
        hint = (" (virtual pipeline chunks model0, model1, ...: merge them with Megatron's tools/checkpoint first)"
                if "model0" in state else "")
        raise ImportMegatronError(f"{path} has no 'model' entry (keys: {keys}){hint}")
    model = {}
    for p, value in found:  # Megatron nests per sub-module; ``_extra_state`` (Transformer Engine) is not a weight
        name = path_name(p[1:])
        if p[:1] == ("model",) and torch.is_tensor(value) and not name.endswith("_extra_state"):
            model[name] = value
    args = state.get("args") if isinstance(state.get("args"), argparse.Namespace) else None
    shared = {path_name(p[1:]): _leaf_key(v) for p, v in found if p[:1] == ("args",) and p[1:2] not in
              [(k,) for k in RANK_ARGS]}
    check_args(args, path)
    return RankFile(path, model, args, shared, state.get("iteration"), checkpoint_version(state, path))


def check_same_checkpoint(first: RankFile, other: RankFile) -> None:
    """``other`` must be a rank file of ``first``'s checkpoint: the same iteration, checkpoint_version and args
    (apart from the process's own rank); else one line naming the first difference."""
    fix = "rank files of different checkpoints are mixed in one folder; copy one checkpoint's whole folder"
    for what, a, b in (("iteration", first.iteration, other.iteration),
                       ("checkpoint_version", first.version, other.version)):
        if _leaf_key(a) != _leaf_key(b):
            raise ImportMegatronError(f"{other.path} is of {what} {shown(b)} but {first.path} of {shown(a)}: {fix}")
    if other.shared_args != first.shared_args:
        keys = list(first.shared_args) + [k for k in other.shared_args if k not in first.shared_args]
        diff = [k for k in keys if first.shared_args.get(k) != other.shared_args.get(k)]
        mine, theirs = (vars(other.args) if other.args else {}), (vars(first.args) if first.args else {})
        shown_diff = [f"{k}={shown(mine.get(k))} vs {shown(theirs.get(k))}" if k in mine or k in theirs else k
                      for k in diff]
        raise ImportMegatronError(f"{other.path} was saved with other args than {first.path} "
                                  f"({len(diff)} differ: {few(shown_diff)}): {fix}")


# args this importer reads: integers >= 1, numbers in a range, booleans (None: absent). Megatron's own parser writes
# them with these types; a string "24" or "False" is a damaged or edited file, refused rather than guessed.
INT_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "seq_length",
            "make_vocab_size_divisible_by", "kv_channels", "ffn_hidden_size", "tensor_model_parallel_size",
            "pipeline_model_parallel_size", "model_parallel_size", "padded_vocab_size")
FLOAT_ARGS = {"hidden_dropout": (0.0, 1.0), "attention_dropout": (0.0, 1.0), "layernorm_epsilon": (0.0, math.inf),
              "init_method_std": (0.0, math.inf)}
BOOL_ARGS = ("apply_query_key_layer_scaling", "attention_softmax_in_fp32", "openai_gelu", "bias_gelu_fusion", "swiglu",
             "squared_relu", "onnx_safe", "group_query_attention", "untie_embeddings_and_output_weights",
             "apply_residual_connection_post_layernorm", "add_bias_linear")


def check_args(args: argparse.Namespace | None, path: Path) -> None:
    """The types and ranges of the args this importer reads (:data:`INT_ARGS`, :data:`FLOAT_ARGS`,
    :data:`BOOL_ARGS`); the first bad one is one line naming it."""
    if args is None:
        return

    def refuse(key: str, want: str) -> ImportMegatronError:
        return ImportMegatronError(f"{path}: args.{key}={shown(getattr(args, key))} is not {want}, as Megatron-LM's "
                                   f"argument parser writes it: a damaged or edited checkpoint; use the file Megatron "
                                   f"saved")

    for key in INT_ARGS:
        v = getattr(args, key, None)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise refuse(key, "an integer >= 1")
    for key, (lo, hi) in FLOAT_ARGS.items():
        v = getattr(args, key, None)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v < hi
        if v is not None and not (ok and (v > 0 or key != "layernorm_epsilon")):
            raise refuse(key, f"a number in [{lo:g}, {hi:g})")
    for key in BOOL_ARGS:
        v = getattr(args, key, None)
        if v is not None and not isinstance(v, bool):
            raise refuse(key, "a boolean")


def check_rank_files(args: argparse.Namespace | None, files: dict[tuple[int, int], Path]) -> None:
    """The rank files must be the TP x PP the checkpoint's own args say (``tensor_model_parallel_size`` or 2020's
    ``model_parallel_size``, ``pipeline_model_parallel_size``): a missing or extra rank file is one line naming it."""
    tp = _arg(args, "tensor_model_parallel_size") or _arg(args, "model_parallel_size")
    if tp is None:
        return
    pp = _arg(args, "pipeline_model_parallel_size", 1)
    folder = next(iter(files.values())).parent.parent
    want = {(t, p) for t in range(tp) for p in range(pp)}
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + f"/{FILE}" for t, p in sorted(want - set(files))]
    extra = [f"{files[k].parent.name}/{FILE}" for k in sorted(set(files) - want)]
    said = f"the checkpoint's args say TP={tp} x PP={pp} ({len(want)} rank files), {len(files)} are there"
    if missing:
        raise ImportMegatronError(f"{folder} lacks {few(missing)}: {said}; copy the whole checkpoint folder")
    if extra:
        raise ImportMegatronError(f"{folder} holds {few(extra)} beyond its TP x PP: {said}; rank files of another "
                                  f"checkpoint mixed in? remove them")


def find_checkpoint(folder: Path) -> tuple[Path, dict[tuple[int, int], Path]]:
    """(iteration folder, {(tp_rank, pp_rank): file}) of a ``--save`` folder (through its tracker file) or
    of one ``iter_*``/``release`` folder."""
    if not folder.is_dir():
        raise ImportMegatronError(f"--checkpoint {folder}: no such folder")
    tracker = folder / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            folder = folder / "release"
        elif text.isdigit():
            folder = folder / f"iter_{int(text):07d}"
        else:
            raise ImportMegatronError(f"{tracker} holds {text[:40]!r}, not an iteration number or 'release'")
    elif not any(folder.glob("mp_rank_*")):
        iters = sorted(folder.glob("iter_*"))
        hint = f" (it has {iters[-1].name}: pass that folder)" if iters else ""
        raise ImportMegatronError(f"--checkpoint {folder} has neither {TRACKER} nor mp_rank_* folders{hint}")
    files = {}
    for d in sorted(folder.glob("mp_rank_*")):
        m = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?", d.name)
        if m is None or not d.is_dir():
            continue
        if not (d / FILE).is_file():
            raise ImportMegatronError(f"{d} lacks {FILE}: an incomplete checkpoint")
        files[(int(m.group(1)), int(m.group(2) or 0))] = d / FILE
    if not files:
        raise ImportMegatronError(f"{folder} holds no mp_rank_XX[_YYY]/{FILE}: not a Megatron-LM checkpoint")
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)
               if (t, p) not in files]
    if missing:
        raise ImportMegatronError(f"{folder} lacks {missing[0]}/{FILE} (TP={tp} x PP={pp} expected): incomplete")
    return folder, files


# A layer's own names -> ours; Megatron renamed attention -> self_attention (2021) and *layernorm -> *norm (2023)
LAYER_NAMES = {
    r"input_(?:layer)?norm": "ln1",
    r"post_attention_(?:layer)?norm": "ln2",
    r"(?:self_)?attention\.query_key_value": "attn.qkv",
    r"(?:self_)?attention\.dense": "attn.proj",
    r"mlp\.dense_h_to_4h": "mlp.fc",
    r"mlp\.dense_4h_to_h": "mlp.proj",
}
# how TP splits each of our tensors in Megatron's files: dim of the split (None: replicated)
SPLIT_DIM = {"attn.qkv": 0, "attn.proj.weight": 1, "mlp.fc": 0, "mlp.proj.weight": 1,
             "embedding.word_embeddings.weight": 0, "lm_head.bias": 0}


def rename(name: str, layer_offset: int) -> str | None:
    """A flattened Megatron name -> ours (layer index shifted by the stage's offset); None = not a weight we
    import (the tied head copy); raises on a name the layout does not have."""
    m = re.fullmatch(r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if m:
        for pattern, ours in LAYER_NAMES.items():
            if re.fullmatch(pattern, m.group(2)):
                return f"layers.{int(m.group(1)) + layer_offset}.{ours}.{m.group(3)}"
        raise ImportMegatronError(f"unknown layer tensor {name!r}: not Megatron-LM's legacy GPT/BERT layout "
                                  f"(a Transformer Engine or Megatron-Core checkpoint?)")
    fixed = {
        "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
        "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
        "language_model.embedding.tokentype_embeddings.weight": "embedding.tokentype_embeddings.weight",
        "language_model.pooler.dense.weight": "pooler.weight", "language_model.pooler.dense.bias": "pooler.bias",
        "lm_head.dense.weight": "lm_head.dense.weight", "lm_head.dense.bias": "lm_head.dense.bias",
        "lm_head.bias": "lm_head.bias", "binary_head.weight": "binary_head.weight",
        "binary_head.bias": "binary_head.bias",
    }
    m = re.fullmatch(r"language_model\.(?:encoder|transformer)\.final_(?:layer)?norm\.(weight|bias)", name)
    if m:
        return f"final_ln.{m.group(1)}"
    m = re.fullmatch(r"lm_head\.(?:layer)?norm\.(weight|bias)", name)
    if m:
        return f"lm_head.ln.{m.group(1)}"
    if name in fixed:
        return fixed[name]
    if name.startswith("word_embeddings_for_head."):
        return None
    if name.startswith("language_model.output_layer."):
        raise ImportMegatronError("the checkpoint has an untied output layer (--untie-embeddings-and-output-weights); "
                                  "only GPT-2/BERT with the output tied to the word embedding import")
    raise ImportMegatronError(f"unknown tensor {name!r}: not Megatron-LM's legacy GPT/BERT layout")


def split_dim(name: str) -> int | None:
    body = re.sub(r"^layers\.\d+\.", "", name)
    for key, dim in SPLIT_DIM.items():
        if body == key or body.startswith(key + "."):
            return dim
    return None


def qkv_to_ours(shard: torch.Tensor, heads: int, version: float) -> torch.Tensor:
    """One TP rank's ``query_key_value`` weight [3 np hn, h] or bias [3 np hn] -> [3, np hn, ...] (its
    queries, keys, values) from the row order of ``checkpoint_version`` (module docstring)."""
    rest = shard.shape[1:]
    if shard.dim() == 0 or shard.size(0) % (3 * heads):
        raise ImportMegatronError(f"a query_key_value shard of shape {list(shard.shape)} does not split into q, k and v "
                                  f"of {heads} heads per TP rank: args or tensors damaged")
    hn = shard.size(0) // (3 * heads)
    if version == 0:
        t = shard.view(3, heads, hn, *rest)
    elif version == 1.0:
        t = shard.view(heads, hn, 3, *rest).movedim(2, 0)
    else:
        t = shard.view(heads, 3, hn, *rest).movedim(1, 0)
    return t.reshape(3, heads * hn, *rest)


def merge_ranks(per_rank: list[dict[str, torch.Tensor]], heads_per_rank: int, version: float
                ) -> dict[str, torch.Tensor]:
    """TP shards of one pipeline stage (our names) -> full tensors; QKV -> rows [Q; K; V]."""
    out = {}
    for name in per_rank[0]:
        parts = [sd[name].detach().to(torch.float32).cpu() for sd in per_rank]
        if ".attn.qkv." in name:
            qkv = [qkv_to_ours(p, heads_per_rank, version) for p in parts]     # each [3, np hn, ...]
            out[name] = torch.cat([torch.cat([t[k] for t in qkv]) for k in range(3)]).contiguous()
            continue
        dim = split_dim(name)
        if dim is None:
            out[name] = parts[0].contiguous()
        else:
            out[name] = torch.cat(parts, dim=dim).contiguous()
    return out


def checkpoint_version(state: dict, path: Path) -> float:
    raw = state.get("checkpoint_version", 0) or 0
    if not isinstance(raw, (int, float)) or isinstance(raw, bool) or not math.isfinite(raw):
        raise ImportMegatronError(f"{path}: checkpoint_version is {shown(raw)}, not a number Megatron-LM wrote "
                                  f"(0, 1.0, 2.0, 3.0)")
    version = float(raw)
    if version not in (0.0, 1.0) and version < 2.0:
        raise ImportMegatronError(f"{path}: checkpoint_version {version} is not one Megatron-LM wrote (0, 1.0, 2.0, 3.0)")
    return version


def check_shards(per_rank: list[dict[str, torch.Tensor]], paths: list[Path]) -> None:
    """The TP ranks of one stage must hold the same tensors (our names) of the same shapes, and the same values
    where Megatron replicates a tensor on every TP rank (LayerNorms, the row-parallel biases, position
    embeddings, ...); else one line naming the tensors and files."""
    fix = "rank files of different checkpoints are mixed in one folder; copy one checkpoint's whole folder"
    for i, sd in enumerate(per_rank[1:], 1):
        if set(sd) != set(per_rank[0]):
            diff = sorted(set(sd) ^ set(per_rank[0]))
            raise ImportMegatronError(f"{paths[i]} holds other tensors than {paths[0]} ({few(diff)}): {fix}")
        shapes = [f"{n} {list(sd[n].shape)} vs {list(per_rank[0][n].shape)}" for n in sd
                  if sd[n].shape != per_rank[0][n].shape]
        if shapes:
            raise ImportMegatronError(f"{paths[i]} holds {len(shapes)} tensor(s) of other shapes than {paths[0]} "
                                      f"({few(shapes)}): {fix}")
        differ = [n for n in sd if split_dim(n) is None and ".attn.qkv." not in n
                  and not torch.equal(sd[n].float(), per_rank[0][n].float())]
        if differ:
            raise ImportMegatronError(f"{len(differ)} tensor(s) every TP rank holds a copy of differ between {paths[0]} "
                                      f"and {paths[i]} ({few(differ)}): {fix}")


def read_weights(files: dict[tuple[int, int], Path], heads: int | None
                 ) -> tuple[dict[str, torch.Tensor], argparse.Namespace | None, float, tuple[int, int]]:
    """All files -> (TP=1 weights in our names, Megatron's args or None, checkpoint_version, (source TP, PP)).
    The first file's args say how many rank files there must be (:func:`check_rank_files`), every other file must
    be of the same checkpoint (:func:`check_same_checkpoint`) and agree with its stage's other ranks
    (:func:`check_shards`), all before any tensor is merged."""
    first = load_file(files[min(files)])
    check_rank_files(first.args, files)
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    args, version = first.args, first.version
    heads = heads or _arg(args, "num_attention_heads")
    if heads is None:
        raise ImportMegatronError("the checkpoint has no args (an early release): pass --num-attention-heads")
    if heads % tp:
        raise ImportMegatronError(f"{heads} attention heads do not split over the source's {tp} TP ranks")
    weights: dict[str, torch.Tensor] = {}
    offset = 0
    for stage in range(pp):
        per_rank, paths, layers = [], [], set()
        for rank in range(tp):
            rf = first if (rank, stage) == min(files) else load_file(files[(rank, stage)])
            check_same_checkpoint(first, rf)
            layers = {int(m.group(1)) for m in (re.match(r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.", k)
                                                for k in rf.model) if m}
            renamed = {}
            for name, t in rf.model.items():
                ours = rename(name, offset)
                if ours is not None:
                    renamed[ours] = t
            per_rank.append(renamed)
            paths.append(rf.path)
        check_shards(per_rank, paths)
        weights.update(merge_ranks(per_rank, heads // tp, version))
        offset += len(layers)
    return weights, args, version, (tp, pp)


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------
def _arg(args, name: str, default=None):
    """``args.name``, ``default`` when there are no args or the value is absent or None (types checked by
    :func:`check_args` when the file was loaded)."""
    value = getattr(args, name, None) if args is not None else None
    return default if value is None else value


def refuse_unsupported(args) -> None:
    """One line naming every Megatron option our GPT-2/BERT does not compute."""
    if args is None:
        return
    checks = {
        "position_embedding_type": ("learned_absolute", None),
        "normalization": ("LayerNorm", None),
        "swiglu": (False, None), "squared_relu": (False, None), "onnx_safe": (False, None),
        "group_query_attention": (False, None),
        "untie_embeddings_and_output_weights": (False, None),
        "apply_residual_connection_post_layernorm": (False, None),
        "add_bias_linear": (True, None),
        "num_experts": (None, 0, 1), "virtual_pipeline_model_parallel_size": (None, 1),
        "transformer_impl": ("local", None),
    }
    bad = []
    for key, ok in checks.items():
        value = getattr(args, key, None)
        if value not in ok and str(value) not in map(str, ok):
            bad.append(f"{key}={value!r}")
    h, n = _arg(args, "hidden_size"), _arg(args, "num_attention_heads")
    kv = _arg(args, "kv_channels")
    if kv is not None and h is not None and n is not None and kv * n != h:
        bad.append(f"kv_channels={kv} (not hidden_size / num_attention_heads)")
    if bad:
        raise ImportMegatronError(f"the checkpoint's args set {', '.join(bad)}, which this project's GPT-2/BERT does "
                                  f"not compute; only Megatron-LM's GPT-2/BERT shapes import")


def gelu_flavours(args, arch: str) -> tuple[str, str | None]:
    """(model.activation, model.lm_head_activation) of Megatron's GeLU flags (module docstring)."""
    if args is None:  # releases without args predate the flags: their GeLU was OpenAI's tanh form
        return "gelu_new", None
    openai = bool(getattr(args, "openai_gelu", False))
    fused = bool(getattr(args, "bias_gelu_fusion", False))
    mlp = "gelu_new" if openai or fused else "gelu"
    head = "gelu_new" if openai else "gelu"
    return mlp, (head if arch == "bert" and head != mlp else None)


def model_config(weights: dict[str, torch.Tensor], args, heads: int, vocab_size: int,
                 seq_length: int | None) -> ModelConfig:
    """Our ModelConfig from Megatron's args and the tensors' shapes (they must agree)."""
    refuse_unsupported(args)
    arch = "bert" if "lm_head.bias" in weights else "gpt2"
    layers = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("layers."))
    hidden = weights["embedding.word_embeddings.weight"].size(1)
    positions = weights["embedding.position_embeddings.weight"].size(0)
    ffn = weights["layers.0.mlp.fc.weight"].size(0)
    if args is not None:
        said = {k: _arg(args, k) for k in ("num_layers", "hidden_size", "max_position_embeddings")}
        found = {"num_layers": layers, "hidden_size": hidden, "max_position_embeddings": positions}
        diff = [f"{k}={said[k]} (tensors: {found[k]})" for k in said if said[k] is not None and said[k] != found[k]]
        if diff:
            raise ImportMegatronError(f"the checkpoint's args disagree with its tensors: {', '.join(diff)}")
    if hidden % heads:
        raise ImportMegatronError(f"hidden size {hidden} is not a multiple of {heads} attention heads")
    seq = seq_length or _arg(args, "seq_length") or positions
    if seq > positions:
        raise ImportMegatronError(f"--seq-length {seq} exceeds the model's {positions} positions")
    activation, head_activation = gelu_flavours(args, arch)
    cfg = ModelConfig(arch=arch, num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                      max_position_embeddings=positions, vocab_size=vocab_size,
                      make_vocab_size_divisible_by=int(_arg(args, "make_vocab_size_divisible_by", 128)),
                      ffn_hidden_size=ffn, hidden_dropout=float(_arg(args, "hidden_dropout", 0.1)),
                      attention_dropout=float(_arg(args, "attention_dropout", 0.1)),
                      init_method_std=float(_arg(args, "init_method_std", 0.02)),
                      layernorm_epsilon=float(_arg(args, "layernorm_epsilon", 1e-5)),
                      apply_query_key_layer_scaling=bool(_arg(args, "apply_query_key_layer_scaling", False)),
                      attention_softmax_in_fp32=bool(_arg(args, "attention_softmax_in_fp32", False)),
                      activation=activation)
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
    kind = given or _arg(args, "tokenizer_type") or ("GPT2BPETokenizer" if arch == "gpt2" else "BertWordPieceLowerCase")
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
    weights, args, version, (src_tp, src_pp) = read_weights(files, heads)
    need = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "layers.0.mlp.fc.weight"]
    lacking = [n for n in need if n not in weights]
    if lacking:
        raise ImportMegatronError(f"{folder} holds no {few(lacking)} (our names for Megatron's tensors): not a "
                                  f"Megatron-LM GPT-2/BERT model")
    heads = heads or _arg(args, "num_attention_heads")
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
        weights = {k: (v[:tok.vocab_size] if k in ("embedding.word_embeddings.weight", "lm_head.bias") else v)
                   for k, v in weights.items()}
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
