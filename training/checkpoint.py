"""Checkpoints through DeepSpeed's ``save_checkpoint``/``load_checkpoint``, our state in ``client_state``.

Layout: RUN_DIR/checkpoints/iter_0000020/mp_rank_XX_model_states.pt (DeepSpeed's files) and
RUN_DIR/checkpoints/latest (the newest complete tag). ``latest`` is written by us, atomically, only
after every rank has finished saving, so a process killed mid-save leaves the previous checkpoint
loadable. Client state: config, iteration, consumed samples, tokenizer spec, partition tags (how TP
shards merge) and every RNG state (DP replicas share RNG streams, so DP rank 0's copy is exact).

Evaluation helpers merge the TP shards of a checkpoint into one TP=1 model.

Every file is read with ``weights_only=True`` (``training.safe_load``): the client state holds only
tensors and plain data, so the numpy RNG state is stored as a list rather than an ndarray.
``latest`` must name a tag directory inside the run's checkpoints/ folder.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from training.config import Config, ConfigError, config_from_dict
from training import safe_load
from training.safe_load import CheckpointError

logger = logging.getLogger("training")

LATEST = "latest"
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once at import (the only way to read it), restored at once


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the file the mode open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_tag(run_dir: str | Path) -> str | None:
    """The tag ``checkpoints/latest`` names; it must be a directory directly inside checkpoints/."""
    f = checkpoint_dir(run_dir) / LATEST
    if not f.is_file():
        return None
    tag = f.read_text().strip()
    check_tag(run_dir, tag, f"{f} names")
    return tag


def check_tag(run_dir: str | Path, tag: str, what: str = "tag") -> None:
    """A tag is one plain directory name under checkpoints/ (never a path leading elsewhere) that exists."""
    root = checkpoint_dir(run_dir)
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or "\0" in tag:
        raise CheckpointError(f"{what} {tag!r}, which is not a checkpoint name (expected e.g. iter_0000020 inside "
                              f"{root}): fix the file or delete it to start afresh")
    if not (root / tag).is_dir():
        have = sorted(p.name for p in root.glob("iter_*") if p.is_dir())
        raise CheckpointError(f"{what} {tag!r} but {root / tag} does not exist (present: {', '.join(have) or 'none'}): "
                              f"write the newest present tag into {root / LATEST} or delete it to start afresh")


def _encode_rng(state: dict) -> dict:
    """RNG states with numpy's (name, uint32 array, pos, has_gauss, cached) as plain data (weights_only)."""
    name, keys, pos, has_gauss, cached = state["numpy"]
    return {**state, "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def _decode_rng(state: dict) -> dict:
    import numpy as np

    name, keys, pos, has_gauss, cached = state["numpy"]
    return {**state, "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)}


def _tag(p) -> tuple[int, int] | None:
    return (p.partition_dim, getattr(p, "partition_stride", 1)) if getattr(p, "tensor_model_parallel", False) else None


def canonical_name(pipe_name: str, num_layers: int) -> str | None:
    """PipelineModule parameter name ('3.attn.qkv.weight') -> GPT2Model name; None for the tied copy."""
    from training.models.gpt2_pipe import pipe_layer_names

    if pipe_name.startswith("tied_modules.embed."):
        return "embedding." + pipe_name[len("tied_modules.embed."):]
    idx, rest = pipe_name.split(".", 1)
    prefix = pipe_layer_names(num_layers).get(int(idx))
    return None if prefix is None else prefix + rest


def canonical_names(trainer) -> dict[str, str]:
    """This rank's parameter names -> GPT2Model names (both tied embedding copies -> embedding.*)."""
    if not trainer.pipe:
        return {n: n for n, _ in trainer.model.named_parameters()}
    return {n: canonical_name(n, trainer.cfg.model.num_layers) for n, _ in trainer.model.named_parameters()}


def optimizer_param_names(trainer) -> list[str | None] | None:
    """Model-parameter names in the order of the torch optimizer's state (None for pipeline-tied
    copies); None when the optimizer does not hold model parameters (fp16 masters, ZeRO)."""
    opt = getattr(trainer.engine, "basic_optimizer", None) or trainer.engine.optimizer
    if not isinstance(opt, torch.optim.Optimizer) or trainer.dtype == "fp16" or trainer.cfg.parallel.zero_stage:
        return None
    names = canonical_names(trainer)
    by_id = {id(p): (None if getattr(p, "ds_pipe_replicated", False) else names[n])
             for n, p in trainer.model.named_parameters()}
    return [by_id.get(id(p)) for g in opt.param_groups for p in g["params"]]


def partition_tags(model: torch.nn.Module, num_layers: int | None = None, pp_group=None) -> dict:
    """{GPT2Model parameter name: (partition_dim, stride) or None}; for a pipeline model the names
    are mapped back and the stages' tags are gathered (collective over ``pp_group``)."""
    if num_layers is None:
        return {n: _tag(p) for n, p in model.named_parameters()}
    mine = {}
    for n, p in model.named_parameters():
        name = canonical_name(n, num_layers)
        if name is not None:
            mine[name] = _tag(p)
    parts = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, mine, group=pp_group)
    return {k: v for part in parts for k, v in part.items()}


def _tokenizer_spec(trainer) -> dict:
    """Tokenizer files copied into RUN_DIR/tokenizer so a run directory is self-contained; the
    returned spec names them relative to RUN_DIR."""
    from megatron_ds_suite.core.corpus import copy_tokenizer_files

    spec = trainer.task.tokenizer.spec()
    if trainer.is_rank0:
        copy_tokenizer_files(spec, trainer.run_dir)
    if dist.is_initialized():
        dist.barrier()
    return {k: (f"tokenizer/{Path(v).name}" if k.endswith("_file") else v) for k, v in spec.items()}


def save(trainer) -> Path:
    """Collective: every rank calls it."""
    from training.parallel import random as tp_random

    tag = f"iter_{trainer.iteration:07d}"
    root = checkpoint_dir(trainer.run_dir)
    client = {
        "config": trainer.cfg.to_dict(),
        "iteration": trainer.iteration,
        "consumed_samples": trainer.consumed_samples,
        "padded_vocab_size": trainer.padded_vocab,
        "tokenizer": _tokenizer_spec(trainer),
        "partition": (partition_tags(trainer.model, trainer.cfg.model.num_layers, trainer.ps.pp_group)
                      if trainer.pipe else partition_tags(trainer.model)),
        "parallel": {"tp": trainer.ps.dims.tp, "pp": trainer.ps.dims.pp, "dp": trainer.ps.dims.dp},
        "tp_rank": trainer.ps.tp_rank,
        "pp_rank": trainer.ps.pp_rank,
        "optimizer_param_names": optimizer_param_names(trainer),
        "rng": _encode_rng(tp_random.get_rng_state()),
        "dtype": trainer.dtype,
    }
    try:
        trainer.engine.save_checkpoint(str(root), tag=tag, client_state=client, save_latest=False)
    except (OSError, RuntimeError) as e:  # a full disk surfaces from torch.save as RuntimeError (zip writer)
        shutil.rmtree(root / tag, ignore_errors=True)  # no half-written checkpoint; `latest` still names a whole one
        cause = (e.strerror if isinstance(e, OSError) and e.strerror else str(e)).strip().splitlines()[-1]
        raise OSError(getattr(e, "errno", None), f"could not write checkpoint {tag} ({cause})", str(root / tag)) from e
    dist.barrier()
    if trainer.is_rank0:
        atomic_write_text(root / LATEST, tag)
        tags = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("iter_"))
        for old in tags[:-max(trainer.cfg.train.keep_last, 1)]:
            shutil.rmtree(root / old, ignore_errors=True)
        logger.info("saved checkpoint %s", root / tag)
    dist.barrier()
    return root / tag


def _remove_unfinished(trainer, latest: str | None) -> None:
    """Checkpoint folders newer than ``latest`` were being written when a run died (killed, out of disk):
    never complete, never named by ``latest``. Rank 0 removes them before training goes on."""
    root = checkpoint_dir(trainer.run_dir)
    if trainer.is_rank0 and root.is_dir():
        for p in sorted(root.glob("iter_*")):
            if p.is_dir() and (latest is None or p.name > latest):
                logger.warning("removing unfinished checkpoint %s (newer than %s: its save never completed)",
                               p, root / LATEST if latest else "any complete checkpoint")
                shutil.rmtree(p, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def load(trainer) -> bool:
    """Resume from RUN_DIR's newest checkpoint, if any. Returns True when it resumed."""
    from training.parallel import random as tp_random

    tag = latest_tag(trainer.run_dir)
    _remove_unfinished(trainer, tag)
    if tag is None:
        return False
    meta = read_client_state(trainer.run_dir, tag)
    if meta.get("weights_only"):  # written by training.tools.import_hf: no optimizer, schedule or RNG to resume
        raise ConfigError(f"{trainer.run_dir} holds imported weights only ({meta.get('imported_from')}), not a run "
                          f"to resume: start a new run from it with train.init_from={trainer.run_dir} and another run.dir")
    saved_sha = (meta.get("tokenizer") or {}).get("sha256")
    if saved_sha and saved_sha != trainer.task.tokenizer.file_sha256():
        raise CheckpointError(f"checkpoint {trainer.run_dir}/checkpoints/{tag} was trained with another tokenizer "
                              f"(file sha256 {saved_sha} vs now {trainer.task.tokenizer.file_sha256()}): resume with "
                              f"the original tokenizer files or start a new run.dir")
    saved = meta["parallel"]
    if (saved["tp"], saved["pp"]) != (trainer.ps.dims.tp, trainer.ps.dims.pp):
        raise ConfigError(f"checkpoint {trainer.run_dir}/checkpoints/{tag} was saved with TP={saved['tp']} "
                          f"PP={saved['pp']} but this run uses TP={trainer.ps.dims.tp} PP={trainer.ps.dims.pp}: "
                          f"convert it with python -m training.tools.reshard --checkpoint {trainer.run_dir} "
                          f"--tp {trainer.ps.dims.tp} --pp {trainer.ps.dims.pp} --out NEW_RUN_DIR, or resume with "
                          f"parallel.tensor={saved['tp']} parallel.pipeline={saved['pp']}")
    safe_load.install()  # DeepSpeed's own reads with weights_only=True as well
    _, client = trainer.engine.load_checkpoint(str(checkpoint_dir(trainer.run_dir)), tag=tag)
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {checkpoint_dir(trainer.run_dir)}")
    trainer.iteration = client["iteration"]
    trainer.consumed_samples = client["consumed_samples"]
    tp_random.set_rng_state(_decode_rng(client["rng"]))
    if trainer.is_rank0:
        logger.info("resumed from %s at iteration %d", tag, trainer.iteration)
    return True


# --------------------------------------------------------------------------------------------------
# Reading checkpoints without an engine (evaluation, export)
# --------------------------------------------------------------------------------------------------
def _model_files(run_dir: str | Path, tag: str | None) -> tuple[str, list[Path]]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {run_dir} does not exist")
    if tag is not None:
        check_tag(run_dir, tag, "--tag")
    tag = tag or latest_tag(run_dir)
    if tag is None:
        raise FileNotFoundError(f"{run_dir} has no checkpoints/latest: train with run.dir={run_dir} first")
    files = sorted((checkpoint_dir(run_dir) / tag).glob("mp_rank_*_model_states.pt"))
    if not files:
        raise FileNotFoundError(f"{checkpoint_dir(run_dir) / tag} holds no mp_rank_*_model_states.pt files")
    return tag, files


def read_client_state(run_dir: str | Path, tag: str | None = None) -> dict:
    _, files = _model_files(run_dir, tag)
    return safe_load.load(files[0])


def load_merged_state_dict(run_dir: str | Path, tag: str | None = None) -> tuple[dict, Config, dict]:
    """TP shards merged into one TP=1 state dict (vocabulary padding kept), the run config and the
    checkpoint metadata (``padded_vocab_size``, ``tokenizer`` spec, ...)."""
    tag, files = _model_files(run_dir, tag)
    meta = safe_load.load(files[0])
    tp, pp = meta["parallel"]["tp"], meta["parallel"]["pp"]
    if len(files) != tp * pp:
        raise FileNotFoundError(f"checkpoint {tag} has {len(files)} model files but was saved with TP={tp} PP={pp}")
    if pp == 1:
        shard_dicts = [safe_load.load(f)["module"] for f in files]
    else:  # pipeline layout: layer_XX-model_YY-model_states.pt, one file per (layer, TP rank)
        num_layers = meta["config"]["model"]["num_layers"]
        shard_dicts = [{} for _ in range(tp)]
        for f in sorted((checkpoint_dir(run_dir) / tag).glob("layer_*-model_*-model_states.pt")):
            idx, rank = int(f.name.split("-")[0][6:]), int(f.name.split("-")[1][6:])
            for k, v in safe_load.load(f).items():
                name = canonical_name(f"{idx}.{k}", num_layers)
                if name is not None:
                    shard_dicts[rank][name] = v
    merged = {}
    for name in shard_dicts[0]:
        tags = meta["partition"].get(name)
        shards = [s[name].float() for s in shard_dicts]
        if tags is None or tp == 1:
            merged[name] = shards[0]
            continue
        dim, stride = tags
        pieces = [s.chunk(stride, dim) for s in shards]
        merged[name] = torch.cat([pieces[r][k] for k in range(stride) for r in range(tp)], dim)
    cfg = config_from_dict(meta["config"])
    cfg.parallel.tensor = 1
    return merged, cfg, meta


def load_model_for_eval(run_dir: str | Path, group=None, device: str = "cpu", tag: str | None = None):
    """(model, config, tokenizer) from a checkpoint of any TP degree, re-split for ``group``'s TP degree
    (None = one process). The model is fp32, in eval mode."""
    from megatron_ds_suite.core.tokenizer import load_tokenizer
    from training.models.gpt2 import GPT2Model
    from training.parallel.layers import _shard_master
    from training.parallel.mappings import group_rank, group_size

    state, cfg, meta = load_merged_state_dict(run_dir, tag)
    tokenizer = load_tokenizer(meta["tokenizer"], base_dir=Path(run_dir))
    world, rank = group_size(group), group_rank(group)
    padded = meta["padded_vocab_size"]
    if padded % world:
        raise ConfigError(f"padded vocabulary {padded} of {run_dir} is not divisible by TP={world}")
    cfg.parallel.tensor = world
    cfg.model.activation_checkpointing = False
    if cfg.model.arch == "bert":
        from training.models.bert import build_bert_for_eval

        model = build_bert_for_eval(cfg.model, padded, group, cfg.train.seed, cfg.model.head == "multiple_choice")
    else:
        model = GPT2Model(cfg.model, padded, group, seed=cfg.train.seed)
    local = {}
    for name, p in model.named_parameters():
        full = state[name]
        tags = meta["partition"].get(name)
        local[name] = _shard_master(full, tags[0], rank, world, tags[1]) if tags and world > 1 else full
    model.load_state_dict(local, strict=True)
    if tokenizer.vocab_size > padded:
        raise ConfigError(f"tokenizer vocabulary {tokenizer.vocab_size} exceeds the model's {padded}")
    return model.to(device).eval(), cfg, tokenizer
