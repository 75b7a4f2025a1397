"""Typed configuration of the main job (``configs/main/*.yaml``), with ``a.b=value`` overrides.

The main job only *orchestrates*: each section names the config file of one stage's own CLI plus a
free-form ``set`` mapping of that CLI's overrides, flattened to ``key.sub=value`` arguments::

    train:
      config: configs/gpt2_tiny.yaml
      set: {train: {iters: 300}, data: {split: "90,5,5"}}    # -> train.iters=300 data.split=90,5,5

Command-line overrides address the main config, so ``train.set.train.iters=50`` changes the number of
training iterations. Unknown keys and wrong types raise :class:`ConfigError` (one line) before any work.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

# the suite's one strict loader (unknown keys, types, Literals, YAML 1.2 floats, a.b=value overrides)
from megatron_ds_suite.core.config import Positive, build_dataclass
from megatron_ds_suite.core.config_yaml import StrictYAMLLoader, apply_overrides, merge_dicts, read_yaml
from megatron_ds_suite.core.errors import ConfigError


@dataclass
class CorpusSection:
    config: str = "configs/data/default.yaml"
    """Corpus builder config (``python -m data_pipeline build --config ...``)."""
    set: dict[str, Any] = field(default_factory=dict)
    """Overrides for the builder, e.g. {dedup: {threshold: 0.8}}. ``output_dir`` defaults to RUN/corpus."""

@dataclass
class TrainSection:
    config: str = "configs/gpt2_tiny.yaml"
    """Run config of ``training.pretrain``; ``data.corpus`` and ``run.dir`` are set by the main job."""
    set: dict[str, Any] = field(default_factory=dict)
    """Overrides for training, e.g. {train: {iters: 300}}."""
    procs: int = 2
    """Processes (``deepspeed --num_gpus``): GPUs on a GPU machine, CPU processes otherwise."""
    launcher: Literal["deepspeed", "python"] = "deepspeed"
    """``deepspeed``: the DeepSpeed launcher; ``python``: one process without it (procs must be 1)."""
    accelerator: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: cpu unless torch sees a GPU (sets DS_ACCELERATOR=cpu for DeepSpeed on CPU)."""

@dataclass
class HeldoutSection:
    enabled: bool = True
    part: Literal["test", "valid"] = "test"
    """Which part of the training run's ``data.split`` (documents never trained on) to score."""
    stride: int = 0
    """Scored tokens per window after the first; 0 = seq_length (non-overlapping, like validation)."""
    batch_size: int = 8
    max_documents: int = 0
    """Score only the first N documents of the part (0 = all)."""

@dataclass
class WikitextSection:
    enabled: bool = True
    data: str | None = None
    """A WikiText-103 ``wiki.test.tokens`` file; used when it exists."""
    hf_dataset: str | None = "wikitext:wikitext-103-v1"
    """Else fetched through ``datasets`` (NAME or NAME:CONFIG) when the network allows; null = never."""
    hf_split: str = "test"
    limit_lines: int = 0
    """Score only the first N lines of the file (0 = all); the report says so."""
    seq_length: int | None = None
    """Window length; null = the model's seq_length."""
    stride: int = 32
    batch_size: int = 8

@dataclass
class LambadaSection:
    enabled: bool = True
    data: str | None = None
    """A LAMBADA ``lambada_test.jsonl`` file; used when it exists."""
    hf_dataset: str | None = "EleutherAI/lambada_openai:default"
    hf_split: str = "test"
    limit: int = 0
    """Score only the first N examples (0 = all)."""
    strict: bool = True
    batch_size: int = 16

@dataclass
class RaceSection:
    """BERT flow: RACE fine-tuning (``training.finetune_race``) then RACE accuracy (``evaluation race``)."""

    config: str = "configs/race.yaml"
    set: dict[str, Any] = field(default_factory=dict)
    """Overrides for fine-tuning; ``finetune.pretrained`` and ``run.dir`` are set by the main job."""
    data: str = "../shared/data/eval/RACE"
    """RACE root with {train,dev,test}/{middle,high}/*.txt (also passed as finetune.race_dir)."""
    split: Literal["train", "dev", "test"] = "test"
    batch_size: int = 4

@dataclass
class EvalSection:
    tp: int = 1
    """Tensor-parallel degree of the evaluation processes (any training TP works)."""
    heldout: HeldoutSection = field(default_factory=HeldoutSection)
    wikitext103: WikitextSection = field(default_factory=WikitextSection)
    lambada: LambadaSection = field(default_factory=LambadaSection)

@dataclass
class MainConfig:
    run_dir: str = "runs/main"
    """Everything goes here: corpus/, train/, eval/, logs/, state.json, report.md."""
    flow: Literal["gpt", "bert"] = "gpt"
    """gpt: corpus -> GPT-2 -> held-out/WikiText/LAMBADA; bert: corpus -> BERT -> RACE fine-tune -> RACE."""
    title: str = "Main job"
    progress: bool = True
    """Progress bars on the console (the logs always get the full output)."""
    network_timeout: Annotated[float, Positive] = 3.0
    """Seconds to wait for huggingface.co before treating the machine as offline."""
    corpus: CorpusSection = field(default_factory=CorpusSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    race: RaceSection = field(default_factory=RaceSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

# ------------------------------------------------------------------------------------------ loading
def _expand_dotted(d: dict[str, Any]) -> dict[str, Any]:
    """{"train.iters": 5, "data": {"split": "1,1,1"}} -> {"train": {"iters": 5}, "data": {"split": ...}}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        parts = str(k).split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        if isinstance(v, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]] = merge_dicts(node[parts[-1]], _expand_dotted(v))
        else:
            node[parts[-1]] = _expand_dotted(v) if isinstance(v, dict) else v
    return out

def load_main_config(path: str | Path | None, overrides: list[str] | None = None) -> MainConfig:
    data: dict[str, Any] = {}
    if path is not None:
        data = read_yaml(path, "main-job config", " (see configs/main/)")
    data = apply_overrides(_expand_dotted(data), overrides, example="train.set.train.iters=50")
    cfg = build_dataclass(MainConfig, _expand_dotted(data))  # again: dotted keys inside mapping-valued overrides
    for name, v in (("train.procs", cfg.train.procs), ("eval.tp", cfg.eval.tp),
                    ("eval.heldout.batch_size", cfg.eval.heldout.batch_size),
                    ("eval.wikitext103.batch_size", cfg.eval.wikitext103.batch_size),
                    ("eval.wikitext103.stride", cfg.eval.wikitext103.stride),
                    ("eval.lambada.batch_size", cfg.eval.lambada.batch_size),
                    ("race.batch_size", cfg.race.batch_size)):
        if v < 1:
            raise ConfigError(f"{name} must be >= 1, got {v}")
    for name, v in (("eval.heldout.stride", cfg.eval.heldout.stride),
                    ("eval.heldout.max_documents", cfg.eval.heldout.max_documents),
                    ("eval.wikitext103.limit_lines", cfg.eval.wikitext103.limit_lines),
                    ("eval.lambada.limit", cfg.eval.lambada.limit)):
        if v < 0:
            raise ConfigError(f"{name} must be >= 0, got {v}")
    if cfg.train.launcher == "python" and cfg.train.procs != 1:
        raise ConfigError(f"train.launcher=python runs one process: set train.procs=1 (got {cfg.train.procs}) "
                          "or use train.launcher=deepspeed")
    return cfg

def flatten(d: dict[str, Any], prefix: str = "") -> list[str]:
    """Nested ``set`` mapping -> ``key.sub=value`` arguments for a stage CLI (values as YAML scalars)."""
    out: list[str] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += flatten(v, key + ".")
            continue
        out.append(f"{key}={yaml_scalar(v)}")
    return out

def yaml_scalar(v: Any) -> str:
    """A value written so that ``yaml.safe_load`` on the other side gives it back unchanged."""
    if isinstance(v, str):
        try:
            if yaml.load(v, Loader=StrictYAMLLoader) == v:  # read back by the stage's loader (core.config_yaml)
                return v
        except yaml.YAMLError:
            pass
    return json.dumps(v)
