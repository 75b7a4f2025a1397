"""Starting a run from a DeepSpeed universal checkpoint: ``train.load_universal: DIR`` (docs/zero.md).

DIR is what ``python -m training.tools.to_universal`` writes: DeepSpeed's ``ds_to_universal`` output for one tag
(``DIR/<tag>/zero/<parameter>/{fp32,exp_avg,exp_avg_sq}.pt``, the source's ``*model_states.pt`` files with this
project's client state) and ``DIR/latest_universal`` naming the tag. A run whose own run directory holds no
checkpoint yet builds its engine with ``checkpoint.load_universal: true`` (:func:`starts_from_universal`, read by
``training.ds_json``) and :func:`load` calls DeepSpeed's ``load_checkpoint`` on DIR: each ZeRO optimizer cuts its
own partition of every parameter's fp32 master and Adam moments for this run's DP size and stage (1, 2 or 3); the client
state gives back the iteration, data position, RNG streams and LR schedule. From its first save on, the run
resumes from its own checkpoints as any other (``train.load_universal`` is then not read).

A TP change goes through as well (TP 1 -> 2 and 2 -> 1, with DP 2 -> 4: ``tests/parallel/test_universal.py``): the
``zero/`` tensors are the whole parameters (the source's TP slices merged by ``training.universal_info``'s patterns),
and DeepSpeed's ``load_hp_checkpoint_state`` cuts this rank's TP slice of each from the same patterns, recorded with
it (``cat_dim``, ``sub_param_shape``), and the parameter's shape, then its DP partition; the model weights are
copied from those fp32 masters (DeepSpeed does not read ``module`` at a universal load). The padded vocabulary must
be the source's (:func:`check_vocab`: the padding rows take part in the softmax); the TP-local RNG stream cannot
carry over to another TP degree, so every stream is seeded from ``train.seed`` + iteration then, as
``training.tools.reshard`` does (:func:`restore_streams`).

Refused in one line before any work (:func:`check_source`): a folder that is not a universal checkpoint, a source of
another PP degree (the PP layout moves through ``training.tools.reshard``) or padded vocabulary, another tokenizer or
model shape, and a source on the other side of ZeRO-3 (DeepSpeed names the model files by stage:
``mp_rank_XX_model_states.pt`` at 1-2, ``zero_pp_rank_D_mp_rank_XX_model_states.pt`` at 3, and looks for its own
stage's; ZeRO-3 -> ZeRO-3 loads, with the repairs of ``training.optim.engine``). The static rules (ZeRO-1/2/3, no
pipeline, not with ``train.init_from``) are ``training.parallel_config.validate_universal_load``.

NOTE: DeepSpeed reads the ``zero/`` files itself with ``torch.load(weights_only=False)`` (its
``load_hp_checkpoint_state``); the model-state files go through ``training.safe_load`` as every resume's do.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_ds_suite.core.errors import ConfigError
from training import safe_load
from training.checkpoint_catalog import plan_resume
from training.config import Config
from training.init_from import SHAPE_KEYS
from training.parallel import random as tp_random

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from training.checkpoint import ModelDescription, TrainState
    from training.parallel.state import ParallelState

logger = logging.getLogger("training")

LATEST_UNIVERSAL = "latest_universal"  # DeepSpeed's name: the tag a universal load reads


def universal_tag(folder: str | Path, what: str = "train.load_universal") -> str:
    """The tag of the universal checkpoint in ``folder`` (``latest_universal`` naming a folder with ``zero/``); one
    ConfigError line when ``folder`` is not one."""
    folder = Path(folder)
    latest = folder / LATEST_UNIVERSAL
    tag = latest.read_text(encoding="utf-8", errors="replace").strip() if latest.is_file() else ""
    if not tag or "/" in tag or not (folder / tag / "zero").is_dir():
        raise ConfigError(f"{what}={folder} is not a universal checkpoint (no {LATEST_UNIVERSAL} naming a folder with "
                          f"zero/): write one with python -m training.tools.to_universal --checkpoint RUN_DIR --out "
                          f"{folder}")
    return tag


def model_state_file(folder: str | Path, tag: str) -> Path:
    """The first ``*model_states.pt`` of ``folder/tag`` (each holds this project's client state)."""
    files = sorted((Path(folder) / tag).glob("*model_states.pt"))
    if not files:
        raise ConfigError(f"universal checkpoint {Path(folder) / tag} has no *model_states.pt file: convert the run "
                          f"again with python -m training.tools.to_universal")
    return files[0]


def starts_from_universal(cfg: Config) -> bool:
    """Whether this run starts from ``train.load_universal``: it is set and the run directory holds no checkpoint to
    resume (reads only; every rank reads alike)."""
    return cfg.train.load_universal is not None and plan_resume(cfg.run.dir, cfg.train.resume_tag).tag is None


def check_vocab(folder: str | Path, source_padded: int, padded: int, tp: int) -> None:
    """One ConfigError line unless this run pads the vocabulary as the source did (``padded`` rows at TP=``tp``):
    DeepSpeed's universal load keeps the source's rows and pads with zero rows only, and the padding rows take part
    in the softmax (``training.tools.reshard.keep_vocab_padding`` keeps them the same way)."""
    if source_padded == padded:
        return
    fix = (f"set model.make_vocab_size_divisible_by={source_padded // tp} to keep them" if source_padded % tp == 0
           else f"choose a parallel.tensor that divides {source_padded}")
    raise ConfigError(f"train.load_universal={folder} has a padded vocabulary of {source_padded} rows but this run "
                      f"pads to {padded} at TP={tp}: {fix}")


def check_source(cfg: Config, tp: int, pp: int, tokenizer_sha: str, padded_vocab: int) -> str:
    """Every refusal of a universal start (one line each) before any work; returns the tag to load."""
    folder = cfg.train.load_universal
    tag = universal_tag(folder)
    meta = safe_load.load(model_state_file(folder, tag))
    saved, source = meta["parallel"], meta["config"]
    if saved["pp"] != pp:
        raise ConfigError(f"train.load_universal={folder} was saved with PP={saved['pp']} but this run uses PP={pp}: "
                          f"start with parallel.pipeline={saved['pp']} (change the PP layout with python -m "
                          f"training.tools.reshard)")
    check_vocab(folder, meta["padded_vocab_size"], padded_vocab, tp)
    stage, target = source["parallel"]["zero_stage"], cfg.parallel.zero_stage
    if (stage == 3) != (target == 3):  # DeepSpeed reads the model files its own stage names
        raise ConfigError(f"train.load_universal={folder} comes from a ZeRO-{stage} run and this run is ZeRO-{target}: "
                          f"DeepSpeed's universal load reads the model files of its own stage (ZeRO-3 names them "
                          f"zero_pp_rank_*, ZeRO-1/2 mp_rank_*); set parallel.zero_stage="
                          f"{'3' if stage == 3 else '1 or 2'} (a universal checkpoint moves a run between ZeRO-1 and 2, "
                          f"or from ZeRO-3 to ZeRO-3)")
    sha = (meta.get("tokenizer") or {}).get("sha256")
    if sha and sha != tokenizer_sha:
        raise ConfigError(f"train.load_universal={folder} was trained with another tokenizer (file sha256 {sha} vs "
                          f"now {tokenizer_sha}): start with the original tokenizer files")
    model = cfg.to_dict()["model"]
    differ = [k for k in SHAPE_KEYS if source["model"].get(k) != model.get(k)]
    if differ:
        k = differ[0]
        raise ConfigError(f"train.load_universal={folder} has model.{k}={source['model'].get(k)} but this run "
                          f"model.{k}={model.get(k)}: set the source's model shape")
    return tag


def load(engine: DeepSpeedEngine, state: TrainState, ps: ParallelState, desc: ModelDescription) -> bool:
    """Collective, for a run that starts from ``train.load_universal`` (:func:`starts_from_universal`, before the
    engine was built with ``checkpoint.load_universal``): the engine and ``state`` from it. Returns True."""
    folder = desc.cfg.train.load_universal
    tag = universal_tag(folder)
    safe_load.install()  # DeepSpeed's reads of the model-state files with weights_only=True
    _, client = engine.load_checkpoint(str(folder), tag=tag)
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load the universal checkpoint {Path(folder) / tag}")
    restore_streams(state, client, ps.dims.tp, desc.cfg.train.seed)
    if ps.rank == 0:
        logger.info("started from universal checkpoint %s at iteration %d (TP %d, DP %d, ZeRO-%d; saved at TP %d)",
                    Path(folder) / tag, state.iteration, ps.dims.tp, ps.dims.dp, desc.cfg.parallel.zero_stage,
                    client["parallel"]["tp"])
    return True


def restore_streams(state: TrainState, client: dict, tp: int, seed: int) -> None:
    """``state`` from the source's client state (DeepSpeed hands every rank one TP rank's: ``mp_rank_XX``); at
    another TP degree the TP-local RNG stream of that rank would be every rank's, so all streams are seeded from
    ``seed`` + iteration instead (as ``training.tools.reshard``; the losses do not change without dropout)."""
    state.restore(client)
    if client["parallel"]["tp"] != tp:
        tp_random.set_seed(seed + state.iteration)
