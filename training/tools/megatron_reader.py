"""Reading the rank files of a Megatron-LM checkpoint (the legacy ``language_model`` layout) for
:mod:`training.tools.import_megatron`: where they are (:func:`find_checkpoint`), loading each without running code
(:func:`load_file`), and the checks that they make one checkpoint with sane ``args`` (:func:`check_rank_files`,
:func:`check_same_checkpoint`, :func:`check_args`, :func:`checkpoint_version`).

The files are pickles. They are loaded with ``torch.load(weights_only=True)`` and an allow-list of what
Megatron stores besides tensors: its ``args`` (``argparse.Namespace``), numpy arrays (RNG states) and
the enums in ``args`` (:data:`MEGATRON_ENUMS`, read as plain strings; Megatron need not be installed).
A file that asks for anything else is refused in one line, before any weight is used.
Each file is then walked once, iteratively and bounded (:mod:`training.tools.untrusted_tree`: depth, entries,
shared sub-structures visited once, cycles refused), so a small crafted file can neither hang the import nor end it
in a ``RecursionError``.

The rank files must make one checkpoint: as many as the TP x PP of the checkpoint's own args (a missing one is
named), all of the same iteration, checkpoint_version and args (but ``rank``). The args read are type-checked
(:data:`INT_ARGS`, :data:`FLOAT_ARGS`, :data:`BOOL_ARGS`).
"""
from __future__ import annotations

import argparse
import enum
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ds_suite.core.errors import SuiteError
from training import safe_load
from training.tools.tensor_check import few
from training.tools.untrusted_tree import leaves, path_name, shown

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
    chunks: list[dict[str, torch.Tensor]]  # ``model`` or, with a virtual pipeline, ``model0``, ``model1``, ...
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
    keys = ["model"] if "model" in state else [f"model{i}" for i in range(sum(f"model{i}" in state for i in range(len(state))))]
    if not keys:
        shown_keys = ", ".join(sorted(k for k in state if isinstance(k, str))[:6])
        raise ImportMegatronError(f"{path} has neither a 'model' entry nor virtual pipeline chunks model0, model1, ... "
                                  f"(keys: {shown_keys})")
    chunks: list[dict[str, torch.Tensor]] = [{} for _ in keys]
    for p, value in found:  # Megatron nests per sub-module; ``_extra_state`` (Transformer Engine) is not a weight
        name = path_name(p[1:])
        if p[:1] and p[0] in keys and torch.is_tensor(value) and not name.endswith("_extra_state"):
            chunks[keys.index(p[0])][name] = value
    args = state.get("args") if isinstance(state.get("args"), argparse.Namespace) else None
    shared = {path_name(p[1:]): _leaf_key(v) for p, v in found if p[:1] == ("args",) and p[1:2] not in
              [(k,) for k in RANK_ARGS]}
    check_args(args, path)
    return RankFile(path, chunks, args, shared, state.get("iteration"), checkpoint_version(state, path))


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
            "pipeline_model_parallel_size", "model_parallel_size", "padded_vocab_size", "num_query_groups", "rotary_base",
            "virtual_pipeline_model_parallel_size")
FLOAT_ARGS = {"hidden_dropout": (0.0, 1.0), "attention_dropout": (0.0, 1.0), "layernorm_epsilon": (0.0, math.inf),
              "norm_epsilon": (0.0, math.inf), "rotary_percent": (0.0, math.nextafter(1.0, 2.0)),
              "init_method_std": (0.0, math.inf), "rope_scaling_factor": (0.0, math.inf)}
BOOL_ARGS = ("apply_query_key_layer_scaling", "attention_softmax_in_fp32", "openai_gelu", "bias_gelu_fusion", "swiglu",
             "squared_relu", "onnx_safe", "group_query_attention", "untie_embeddings_and_output_weights",
             "apply_residual_connection_post_layernorm", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
             "rotary_interleaved", "use_rope_scaling")


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
        if v is not None and not (ok and (v > 0 or key not in ("layernorm_epsilon", "norm_epsilon", "rotary_percent"))):
            raise refuse(key, f"a number in [{lo:g}, {hi:g})")
    for key in BOOL_ARGS:
        v = getattr(args, key, None)
        if v is not None and not isinstance(v, bool):
            raise refuse(key, "a boolean")


def check_rank_files(args: argparse.Namespace | None, files: dict[tuple[int, int], Path]) -> None:
    """The rank files must be the TP x PP the checkpoint's own args say (``tensor_model_parallel_size`` or 2020's
    ``model_parallel_size``, ``pipeline_model_parallel_size``): a missing or extra rank file is one line naming it."""
    tp = megatron_arg(args, "tensor_model_parallel_size") or megatron_arg(args, "model_parallel_size")
    if tp is None:
        return
    pp = megatron_arg(args, "pipeline_model_parallel_size", 1)
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


def find_checkpoint(folder: Path) -> tuple[Path, dict[tuple[int, int], Path]]:  # noqa: C901
    """(iteration folder, {(tp_rank, pp_rank): file}) of a ``--save`` folder (through its tracker file) or
    of one ``iter_*``/``release`` folder; no files for a ``torch_dist`` folder (``metadata.json``, ``*.distcp``)."""
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
    elif not any(folder.glob("mp_rank_*")) and not any(folder.glob("*.distcp")):
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
    if not files and (any(folder.glob("*.distcp")) or (folder / "metadata.json").is_file()):
        return folder, {}  # a torch_dist folder: training.tools.torch_dist_reader reads it whole
    if not files:
        raise ImportMegatronError(f"{folder} holds no mp_rank_XX[_YYY]/{FILE}: not a Megatron-LM checkpoint")
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)
               if (t, p) not in files]
    if missing:
        raise ImportMegatronError(f"{folder} lacks {missing[0]}/{FILE} (TP={tp} x PP={pp} expected): incomplete")
    return folder, files


def checkpoint_version(state: dict, path: Path) -> float:
    raw = state.get("checkpoint_version", 0) or 0
    if not isinstance(raw, (int, float)) or isinstance(raw, bool) or not math.isfinite(raw):
        raise ImportMegatronError(f"{path}: checkpoint_version is {shown(raw)}, not a number Megatron-LM wrote "
                                  f"(0, 1.0, 2.0, 3.0)")
    version = float(raw)
    if version not in (0.0, 1.0) and version < 2.0:
        raise ImportMegatronError(f"{path}: checkpoint_version {version} is not one Megatron-LM wrote (0, 1.0, 2.0, 3.0)")
    return version


def megatron_arg(args, name: str, default=None):
    """``args.name``, ``default`` when there are no args or the value is absent or None (types checked by
    :func:`check_args` when the file was loaded)."""
    value = getattr(args, name, None) if args is not None else None
    return default if value is None else value
