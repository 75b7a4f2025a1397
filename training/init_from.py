"""Start a run from another checkpoint's weights: ``train.init_from=RUN_DIR`` (GPT-2 and BERT).

The source may have any TP/PP layout (its shards are merged by their partition tags and re-split for
this run's TP degree, its vocabulary padding re-cut for this run's padding) and may be an import
(``python -m training.tools.import_hf``) or a finished run. Only weights move: the optimizer, LR schedule,
iteration and data position start fresh. The model *shape* (:data:`SHAPE_KEYS`) is the source's;
everything else (sequence length up to its positions, dropout, batch, optimizer, data, TP/PP) is this
run's config. Once this run has saved a checkpoint of its own, resuming from it wins and
``init_from`` is no longer read.

Both halves run before the engine exists and take explicit parts, never the trainer:
:func:`adopted_shape` reads the source's shape for resolving the config (:func:`training.resolve.resolve_run`
sets it before the one validation and the freeze) and :func:`load_weights` fills a built model (its parallel state and a
:class:`~training.checkpoint.ModelDescription` say which shards and vocabulary padding).
RACE fine-tuning (:mod:`training.finetune_race`) loads its pretrained encoder through the same
:func:`local_weights`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_ds_suite.core.config import build_dataclass
from megatron_ds_suite.core.errors import ConfigError
from training import checkpoint_catalog as catalog
from training.checkpoint_catalog import plan_resume
from training.checkpoint_reader import canonical_name, load_merged_state_dict, read_client_state
from training.config import Config
from training.models.config import ModelConfig, RopeScalingConfig
from training.parallel.sharding import is_vocab_sized, resize_vocab_rows, shard
from training.runtime.run_lock import overlapping_input

if TYPE_CHECKING:
    from training.checkpoint import ModelDescription
    from training.parallel.state import ParallelState

logger = logging.getLogger("training")

# model keys that determine parameter shapes or the computed function: taken from the source
SHAPE_KEYS = ("arch", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "max_position_embeddings", "vocab_size", "layernorm_epsilon", "activation", "layer_order",
              "num_tokentypes", "lm_head_activation", "position_embedding", "rotary_base", "rotary_percent", "rope_scaling", "normalization",
              "num_query_groups", "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias")


def local_weights(named_params: Iterable[tuple[str, torch.nn.Parameter]], state: dict[str, torch.Tensor],
                  padded: int, rank: int, world: int,
                  canonical: Callable[[str], str | None] = lambda n: n) -> dict[str, torch.Tensor]:
    """This TP rank's shard of every parameter that ``state`` (a merged TP=1 state dict) holds.

    ``canonical`` maps a parameter name to its name in ``state`` (pipeline models); parameters the
    state lacks are left out (the caller keeps their fresh initialisation). Raises ConfigError on a
    shape mismatch.
    """
    local = {}
    for name, p in named_params:
        key = canonical(name)
        if key is None or key not in state:
            continue
        full = state[key]
        if is_vocab_sized(key):
            full = resize_vocab_rows(full, padded)
        if getattr(p, "tensor_model_parallel", False) and world > 1:
            full = shard(full, p.partition_dim, rank, world, getattr(p, "partition_stride", 1))
        if tuple(full.shape) != tuple(p.shape):
            raise ConfigError(f"checkpoint weight {key} has shape {tuple(full.shape)} but this model's is "
                              f"{tuple(p.shape)}: the model configs differ")
        local[name] = full.to(p.dtype)
    return local


def _source_meta(run_dir: str, tag: str | None = None) -> dict:
    try:
        return read_client_state(run_dir, tag)
    except (FileNotFoundError, OSError) as e:
        raise ConfigError(f"train.init_from={run_dir}: {e}") from None


def apart_from_source(run_dir: str | Path, key: str, src: str | Path) -> None:
    """Refuse a ``run.dir`` that holds the source run ``src`` or lies inside it (symlinks resolved): the new run
    would write its checkpoints, ``latest`` and metrics into the run it reads, or a later ``--overwrite`` of one
    would destroy the other. The same folder has its own message at the caller."""
    reason = overlapping_input(run_dir, {key: src})
    if reason is not None and not reason.startswith("is "):
        raise ConfigError(f"run.dir={run_dir} {reason}: the new run would write into or around the run it starts "
                          f"from; choose a run.dir outside {src} that does not hold it")


def adopted_shape(cfg: Config) -> dict[str, Any]:
    """The source checkpoint's model shape (:data:`SHAPE_KEYS` -> value) for ``cfg.model``; empty without
    ``train.init_from``. Reads, never writes: :func:`training.resolve.resolve_run` sets it, before the one
    validation and the freeze."""
    src = cfg.train.init_from
    if not src:
        return {}
    if Path(src).resolve() == Path(cfg.run.dir).resolve():
        raise ConfigError(f"train.init_from={src} is this run's own directory: to resume a run just rerun it; "
                          "init_from starts a new run.dir from another run's weights")
    apart_from_source(cfg.run.dir, "train.init_from", src)
    # resuming: the run's own checkpoint has the adopted shape (and the source may be gone by now)
    own = plan_resume(cfg.run.dir, cfg.train.resume_tag).tag
    theirs = (_source_meta(cfg.run.dir, own) if own else _source_meta(src))["config"]["model"]
    if theirs.get("head", "pretrain") == "multiple_choice":
        raise ConfigError(f"train.init_from={src} is a RACE multiple-choice fine-tune; start from a pretrained model")
    shape: dict[str, Any] = {}
    defaults = ModelConfig()  # a checkpoint older than a key has that key's default
    for key in SHAPE_KEYS:
        value = theirs.get(key, getattr(defaults, key))
        if key == "max_position_embeddings":
            value = value or theirs["seq_length"]
        if key == "rope_scaling" and isinstance(value, dict):  # a saved config holds it as a mapping
            value = build_dataclass(RopeScalingConfig, value, "model.rope_scaling")
        if key == "arch" and {value, cfg.model.arch} == {"gpt", "gpt2"}:  # two names of one family
            continue
        shape[key] = value
    if cfg.model.seq_length > shape["max_position_embeddings"]:
        raise ConfigError(f"model.seq_length={cfg.model.seq_length} exceeds the {shape['max_position_embeddings']} "
                          f"positions of train.init_from={src}: lower model.seq_length")
    return shape


def load_weights(model: torch.nn.Module, desc: ModelDescription, ps: ParallelState) -> bool:
    """Load ``train.init_from``'s weights into ``model`` (this rank's TP shards, before the DeepSpeed engine
    exists). Skipped when the run resumes from its own checkpoint. Returns True if weights were loaded."""
    cfg = desc.cfg
    src = cfg.train.init_from
    if not src or catalog.plan_resume(desc.run_dir, cfg.train.resume_tag).tag is not None:
        return False
    state, src_cfg, meta = load_merged_state_dict(src)
    tok = desc.tokenizer
    if src_cfg.model.vocab_size is not None and src_cfg.model.vocab_size != tok.vocab_size:
        raise ConfigError(f"train.init_from={src} was trained with a {src_cfg.model.vocab_size}-id tokenizer but this "
                          f"run's data uses {tok.vocab_size} ids ({tok.kind}): train on data tokenized with the "
                          f"checkpoint's tokenizer ({meta['tokenizer'].get('kind')})")
    layers = desc.pipeline_layers
    if layers is not None:
        canonical = lambda n: canonical_name(n, layers)  # noqa: E731
    else:
        canonical = lambda n: n  # noqa: E731
    params = list(model.named_parameters())
    local = local_weights(params, state, desc.padded_vocab, ps.tp_rank, ps.dims.tp, canonical)
    with torch.no_grad():
        for name, p in params:
            if name in local:
                p.copy_(local[name])
    fresh = [n for n, _ in params if n not in local]
    if ps.rank == 0:
        logger.info("initialised %d of %d parameter tensors from %s%s", len(local), len(params), src,
                    f"; fresh: {', '.join(fresh)}" if fresh else "")
    return True
