"""Reading checkpoints without an engine (evaluation, export, fine-tuning, ``train.init_from``).

The layout of RUN_DIR/checkpoints (``latest`` names a tag directory; DeepSpeed's mp_rank_XX files hold
the client state written by :mod:`training.checkpoint`), and the merge of a checkpoint's TP shards (and
pipeline stages) into one TP=1 state dict, re-split for any TP degree.

Every file is read with ``weights_only=True`` (``training.safe_load``); ``latest`` must name a tag
directory inside the run's checkpoints/ folder.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_ds_suite.core.errors import ConfigError
from training import checkpoint_catalog as catalog
from training import safe_load
from training.checkpoint_catalog import LATEST, check_tag, checkpoint_dir  # noqa: F401 - re-exported
from training.config import Config, config_from_dict
from training.parallel.mappings import group_rank, group_size
from training.parallel.sharding import merge_tagged, shard_tagged
from training.safe_load import CheckpointError, CheckpointMissing  # noqa: F401 - CheckpointError re-exported

GATHERED_WEIGHTS = "mp_rank_{:02d}_gathered_weights.pt"
"""A ZeRO-3 checkpoint's weights (each TP rank's shard whole) and client state, one file per TP rank written by its
DP rank 0 beside DeepSpeed's ``zero_pp_rank_*`` files (:mod:`training.checkpoint`; ``.format(tp_rank)``); named apart
from DeepSpeed's ``*_model_states.pt``, which its own tools (``ds_to_universal``, ``zero_to_fp32``) read as one file
per rank."""


def latest_tag(run_dir: str | Path) -> str | None:
    """The tag ``checkpoints/latest`` names; it must be a directory directly inside checkpoints/."""
    return catalog.read_latest(run_dir)


@dataclass(frozen=True)
class PipeNames:
    """How a pipeline model's parameter names map back to the PP=1 model's: its architecture (``model.arch``) and
    transformer layer count pick the layer table (``training.models.gpt2_pipe.pipe_layer_names``,
    ``training.models.bert_pipe.bert_model_name``)."""

    arch: str
    num_layers: int

    @classmethod
    def of(cls, model_cfg) -> PipeNames:
        """The names of a model config (``cfg.model``, or its dict in a checkpoint's metadata)."""
        get = model_cfg.get if isinstance(model_cfg, dict) else lambda k: getattr(model_cfg, k)
        return cls("bert" if get("arch") == "bert" else "gpt", int(get("num_layers")))


def canonical_name(pipe_name: str, names: PipeNames) -> str | None:
    """PipelineModule parameter name ('3.attn.qkv.weight') -> the PP=1 model's name; None for the tied copy."""
    if names.arch == "bert":
        from training.models.bert_pipe import bert_model_name

        return bert_model_name(pipe_name, names.num_layers)
    from training.models.gpt2_pipe import pipe_layer_names

    if pipe_name.startswith("tied_modules.embed."):
        return "embedding." + pipe_name[len("tied_modules.embed."):]
    idx, rest = pipe_name.split(".", 1)
    prefix = pipe_layer_names(names.num_layers, untied=True).get(int(idx))  # a tied model has no 'L+2.' names
    return None if prefix is None else prefix + rest


def model_files(run_dir: str | Path, tag: str | None) -> tuple[str, list[Path]]:
    """(tag, the ``mp_rank_*_model_states.pt`` files) of checkpoint ``tag`` (else the latest) of ``run_dir``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointMissing(f"checkpoint directory {run_dir} does not exist")
    if tag is not None:
        check_tag(run_dir, tag, "--tag")
    tag = tag or latest_tag(run_dir)
    if tag is None:
        if (run_dir / "corpus.json").is_file():
            raise CheckpointMissing(f"{run_dir} is a corpus folder (it holds corpus.json), not a training run: pass the "
                                    f"run directory a training wrote (run.dir), which holds checkpoints/latest")
        newest = catalog.newest_complete(catalog.scan(run_dir))
        if newest is not None:
            raise CheckpointMissing(f"{run_dir} has no checkpoints/latest but holds complete checkpoints (the newest is "
                                    f"{newest.name}): pass --tag {newest.name}, or write {newest.name} into "
                                    f"{checkpoint_dir(run_dir) / LATEST}")
        raise CheckpointMissing(f"{run_dir} has no checkpoints/latest: train with run.dir={run_dir} first")
    catalog.verify(run_dir, tag)
    files = sorted((checkpoint_dir(run_dir) / tag).glob("mp_rank_*_model_states.pt"))
    if not files:  # ZeRO-3: one file of gathered weights per TP rank
        files = sorted((checkpoint_dir(run_dir) / tag).glob(GATHERED_WEIGHTS.replace("{:02d}", "*")))
    if not files:
        raise CheckpointMissing(f"{checkpoint_dir(run_dir) / tag} holds no mp_rank_*_model_states.pt files")
    return tag, files


def read_client_state(run_dir: str | Path, tag: str | None = None) -> dict:
    _, files = model_files(run_dir, tag)
    return safe_load.load(files[0])


def load_merged_state_dict(run_dir: str | Path, tag: str | None = None) -> tuple[dict, Config, dict]:
    """TP shards merged into one TP=1 state dict (vocabulary padding kept), the run config and the
    checkpoint metadata (``padded_vocab_size``, ``tokenizer`` spec, ...)."""
    tag, files = model_files(run_dir, tag)
    meta = safe_load.load(files[0])
    tp, pp = meta["parallel"]["tp"], meta["parallel"]["pp"]
    if len(files) != tp * pp:
        raise CheckpointMissing(f"checkpoint {tag} of {run_dir} has {len(files)} model file(s) but was saved with "
                                f"TP={tp} PP={pp} ({tp * pp} files): a shard is missing; copy the whole tag folder")
    if pp == 1:
        shard_dicts = [safe_load.load(f)["module"] for f in files]
    else:  # pipeline layout: layer_XX-model_YY-model_states.pt, one file per (layer, TP rank)
        names = PipeNames.of(meta["config"]["model"])
        shard_dicts = [{} for _ in range(tp)]
        for f in sorted((checkpoint_dir(run_dir) / tag).glob("layer_*-model_*-model_states.pt")):
            idx, rank = int(f.name.split("-")[0][6:]), int(f.name.split("-")[1][6:])
            for k, v in safe_load.load(f).items():
                name = canonical_name(f"{idx}.{k}", names)
                if name is not None:
                    shard_dicts[rank][name] = v
    merged = {name: merge_tagged([s[name].float() for s in shard_dicts], meta["partition"].get(name))
              for name in shard_dicts[0]}
    cfg = config_from_dict(meta["config"])
    cfg.parallel.tensor = 1
    return merged, cfg, meta


def load_model_for_eval(run_dir: str | Path, group=None, device: str = "cpu", tag: str | None = None):
    """(model, config, tokenizer) from a checkpoint of any TP degree, re-split for ``group``'s TP degree
    (None = one process). The model is fp32, in eval mode."""
    from megatron_ds_suite.core.tokenizer import load_tokenizer
    from training.models.gpt2 import GPTModel
    state, cfg, meta = load_merged_state_dict(run_dir, tag)
    tokenizer = load_tokenizer(meta["tokenizer"], base_dir=Path(run_dir))
    world, rank = group_size(group), group_rank(group)
    padded = meta["padded_vocab_size"]
    if padded % world:
        raise ConfigError(f"padded vocabulary {padded} of {run_dir} is not divisible by TP={world}")
    cfg.parallel.tensor = world
    cfg.model.recompute = "none"
    if cfg.model.arch == "bert":
        from training.models.bert import build_bert_for_eval

        model = build_bert_for_eval(cfg.model, padded, group, cfg.train.seed, cfg.model.head == "multiple_choice")
    else:
        model = GPTModel(cfg.model, padded, group, seed=cfg.train.seed)
    local = {}
    for name, p in model.named_parameters():
        local[name] = shard_tagged(state[name], meta["partition"].get(name), rank, world)
    model.load_state_dict(local, strict=True)
    if tokenizer.vocab_size > padded:
        raise ConfigError(f"tokenizer vocabulary {tokenizer.vocab_size} exceeds the model's {padded}")
    return model.to(device).eval(), cfg, tokenizer
