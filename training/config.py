"""Typed run configuration for training: one YAML file per run, the single source of truth.

Precedence: command-line overrides (``section.key=value``) > YAML file > dataclass defaults.
Unknown keys, wrong types and inconsistent sizes fail at once with one line that says what is wrong
and how to fix it (:class:`ConfigError`), before any process group or model exists.

The model's shape, its ``model:`` section, is :class:`training.models.config.ModelConfig` (beside the models);
the DeepSpeed JSON is derived in :mod:`training.ds_json`; resolving the loaded config for a process group
(init_from's shape, vocabulary, the task's schedule, ``recompute: auto``) and freezing it is
:mod:`training.resolve`'s.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from megatron_ds_suite.core.config import (
    AtLeastOne,
    Fraction,
    Freezable,
    NonNegative,
    Positive,
    Range,
    build_dataclass,
    check_ranges,
)
from megatron_ds_suite.core.config_yaml import apply_overrides, overrides_to_dict, read_yaml
from megatron_ds_suite.core.errors import ConfigError

# the model, parallel and eval sections' types: Config's annotations name them, and build_dataclass resolves those
# names in this module's namespace (a genuine use, not a re-export for callers: they import from
# training.models.config, training.parallel_config and training.eval_config)
from training.eval_config import EvalConfig, validate_eval
from training.models.config import OLD_RECOMPUTE_KEY, ModelConfig, validate_model_options, validate_shape
from training.parallel_config import (
    ParallelConfig,
    validate_context,
    validate_pipeline_schedule,
    validate_universal_load,
    validate_zero,
)


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------
@dataclass
class PrecisionConfig(Freezable):
    dtype: Literal["auto", "fp16", "bf16", "fp32"] = "auto"
    """'auto' = fp16 on a GPU (the paper's default), fp32 on CPU."""
    allow_fp16_on_cpu: bool = False
    """Let DeepSpeed's fp16 engine run on the CPU accelerator (slow; for tests of tiny models)."""
    loss_scale: Annotated[float, NonNegative] = 0.0
    """0 = dynamic loss scaling; > 0 = static scale."""
    initial_scale_power: Annotated[int, NonNegative] = 32
    """Initial dynamic scale 2**power (Megatron: 2**32)."""
    loss_scale_window: Annotated[int, AtLeastOne] = 1000
    hysteresis: Annotated[int, AtLeastOne] = 2
    min_loss_scale: Annotated[float, Positive] = 1.0
    max_consecutive_skipped: Annotated[int, NonNegative] = 50
    """Abort when this many consecutive steps were skipped for overflow (0 disables)."""


@dataclass
class OptimizerConfig(Freezable):
    lr: float = 1.5e-4
    min_lr: float = 1.0e-5
    weight_decay: Annotated[float, NonNegative] = 0.01
    """Decoupled (AdamW) weight decay; biases and LayerNorm parameters are exempt."""
    beta1: Annotated[float, Range(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Range(ge=0, lt=1)] = 0.999
    eps: Annotated[float, Positive] = 1.0e-8
    clip_grad: Annotated[float, NonNegative] = 1.0
    """Global grad-norm clipping across TP ranks (0 disables)."""
    warmup_iters: Annotated[int, NonNegative] = 0
    decay_iters: Annotated[int, NonNegative] | None = None
    """Iterations of warmup + decay; None = train.iters."""
    decay_style: Literal["cosine", "linear", "constant"] = "cosine"


@dataclass
class TrainConfig(Freezable):
    micro_batch_size: int = 4
    """Samples per forward/backward on one data-parallel replica."""
    global_batch_size: int = 8
    """Samples per optimizer step over all replicas = micro x grad-accum x DP."""
    iters: int = 20
    seed: Annotated[int, NonNegative] = 1234
    log_interval: int = 1
    """A step line every N iterations (and the last; 0 = none). Negative intervals are refused."""
    eval_interval: int = 0
    """Validation every N iterations (0 = only at the end)."""
    eval_iters: int = 2
    save_interval: int = 0
    """Checkpoint every N iterations (0 = only at the end)."""
    keep_last: int = 2
    """Keep this many newest checkpoints."""
    resume_tag: str | None = None
    """Resume from this checkpoint tag (e.g. iter_0000020) instead of the one `checkpoints/latest` names; needed when
    `latest` is lost, or to go back to an older checkpoint on purpose: the newer ones are moved to
    checkpoints/superseded/, never deleted (see training.checkpoint_catalog)."""
    exit_at: Annotated[int, AtLeastOne] | None = None
    """Save and stop at this iteration (the schedule still runs to `iters`); rerun to resume."""
    progress_bar: bool | None = None
    """Progress bar on stderr: None = only when stderr is a terminal (not in Slurm logs); true/false force it."""
    init_from: str | None = None
    """Run directory (any TP/PP, e.g. written by training.tools.import_hf) whose weights start this run, with a
    fresh optimizer, schedule and data position; its model shape replaces model.* (see training.init_from).
    Ignored once this run has a checkpoint of its own (resume wins)."""
    load_universal: str | None = None
    """A universal checkpoint folder (``python -m training.tools.to_universal``) this run starts from: weights, Adam
    moments, LR schedule, iteration, data position and RNG streams, at this run's TP degree, DP size and ZeRO stage
    (1 or 2; PP=1; the source's padded vocabulary; docs/zero.md). Ignored once this run has a checkpoint of its own
    (resume wins)."""


@dataclass
class DataConfig(Freezable):
    corpus: str | None = None
    """Corpus directory written by `python -m data_pipeline build` (indexed dataset + tokenizer)."""
    text_files: list[str] = field(default_factory=list)
    """Alternative to `corpus`: plain text files tokenized into one token stream (quick experiments)."""
    tokenizer: dict[str, Any] = field(default_factory=dict)
    """Tokenizer spec for text_files, e.g. {kind: gpt2_bpe, vocab_file: ..., merges_file: ...}."""
    prefixes: list[list[Any]] = field(default_factory=list)
    """Alternative to `corpus`: Megatron .bin/.idx datasets blended by weight, [[0.3, /data/a_text_document],
    [0.7, /data/b]] (GPT-2; tokenizer from data.tokenizer; see training.data.blending)."""
    split: str = "969,30,1"
    """train,valid,test proportions over documents (of each prefix when blending)."""
    split_convention: Literal["megatron_lm", "megatron_core"] = "megatron_lm"
    """Whose document split and per-prefix sample counts to follow: Megatron-LM 2021's (rounded parts) or
    Megatron-Core's BlendedMegatronDatasetBuilder (rounded cumulative boundaries, ceil(ceil(N w) x 1.005)
    samples per prefix); see training/data/split_convention.py and docs/megatron_interop.md."""
    separate_last_epoch: bool | None = None
    """GPT sample order: True = Megatron 2021+ shuffles a short last epoch (< 80 % used) apart from the
    others; False = Megatron 2020 (all epochs shuffled together); None (default) = False for data.corpus
    and data.text_files, True for data.prefixes (Megatron's blending came with it) and for
    split_convention megatron_core. See training/data/gpt_dataset.py and training/data/blending.py."""
    num_workers: Annotated[int, NonNegative] = 0
    reset_position_ids: bool = False
    """GPT: positions restart at 0 after each end-of-document token inside a packed sample (Megatron's
    --reset-position-ids; training/data/documents.py)."""
    reset_attention_mask: bool = False
    """GPT: a token attends only to its own document inside a packed sample (Megatron's --reset-attention-mask;
    a block-diagonal causal mask, b s^2 bytes per micro-batch)."""
    eod_mask_loss: bool = False
    """GPT: no loss where the input token is the end-of-document token (Megatron's --eod-mask-loss)."""

    def document_options(self) -> list[str]:
        return [n for n in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(self, n)]


@dataclass
class WandbConfig(Freezable):
    """Weights & Biases through DeepSpeed's monitor (training.tracking); needs the ``tracking`` extra."""

    enabled: bool = False
    project: str = "megatron-ds-suite"
    entity: str | None = None
    """W&B user or team (DeepSpeed's ``team``); None = the logged-in default."""
    group: str | None = None
    name: str | None = None
    """Run name; None = W&B's generated one."""
    mode: Literal["online", "offline"] = "online"
    """'offline' writes RUN_DIR/wandb/ without network (upload later with ``wandb sync``)."""


@dataclass
class RunConfig(Freezable):
    dir: str = "runs/default"
    """Run directory: config, DeepSpeed JSON, metrics.jsonl, checkpoints."""
    tensorboard: bool = False
    """TensorBoard through DeepSpeed's monitor (writes RUN_DIR/tensorboard)."""
    csv: bool = False
    """CSV files through DeepSpeed's monitor: RUN_DIR/csv/train/<metric>.csv."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B through DeepSpeed's monitor (project, entity, group, online/offline)."""
    device_peak_tflops: Annotated[float, Positive] | None = None
    """Dense peak TFLOP/s of one device in the training dtype, for MFU; None = built-in table."""
    device_kind: str | None = None
    """Name of the device for the peak table (e.g. 'h100-sxm', 'v100', 'cpu'); None = detect."""


@dataclass
class BertDataConfig(Freezable):
    """BERT pretraining samples (training.data.bert_data); ignored by GPT-2."""

    masked_lm_prob: Annotated[float, Range(gt=0, le=1)] = 0.15
    """Fraction of each sample's tokens to predict (Megatron: round(0.15 x length), at least 1, at most the
    float 0.15 x target length: 18 of 128)."""
    mask_token_prob: Annotated[float, Fraction] = 0.8
    """Of the predicted tokens: replaced by [MASK] ..."""
    random_token_prob: Annotated[float, Fraction] = 0.1
    """... by a random vocabulary token (the rest, 1 - 0.8 - 0.1, stay unchanged)."""
    max_ngram: Annotated[int, AtLeastOne] = 3
    """Masked spans are n-grams of 1..max_ngram whole words with p(n) proportional to 1/n."""
    whole_word: bool = True
    """Never split a word: a word's pieces are masked together."""
    short_seq_prob: Annotated[float, Fraction] = 0.1
    """Probability that a sample targets a random shorter length (Megatron's short_seq_prob)."""


@dataclass
class FinetuneConfig(Freezable):
    """RACE fine-tuning (python -m training.finetune_race); ignored by pretraining."""

    pretrained: str | None = None
    """Run directory of a pretrained BERT (checkpoints/latest; any TP degree)."""
    race_dir: str | None = None
    """RACE root folder with train/, dev/, test/ each holding middle/ and high/ *.txt."""
    train_split: str = "train"
    valid_split: str = "dev"
    test_split: str | None = "test"
    """Also scored every epoch (reported for the best-dev epoch); None = skip."""
    levels: list[str] = field(default_factory=lambda: ["middle", "high"])
    epochs: Annotated[int, AtLeastOne] = 3
    seq_length: Annotated[int, AtLeastOne] | None = None
    """RACE sequence length; None = model.seq_length (Megatron: 512)."""
    max_qa_length: Annotated[int, AtLeastOne] = 128
    warmup_fraction: Annotated[float, Fraction] = 0.06
    """Linear warmup over this fraction of all fine-tuning steps, then linear decay (Megatron: 0.06)."""
    eval_batch_size: Annotated[int, AtLeastOne] = 8
    """Questions per forward when scoring dev/test."""


@dataclass
class Config(Freezable):
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    bert: BertDataConfig = field(default_factory=BertDataConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    deepspeed: dict[str, Any] = field(default_factory=dict)
    """Raw DeepSpeed options merged into the derived JSON (training.tracking); keys the run config owns
    are refused."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------------
# Loading: dict -> dataclass with strict key and type checks
# --------------------------------------------------------------------------------------------------
def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["train.iters=50", "parallel.tensor=2"]`` -> nested dict; values parsed as YAML scalars."""
    return overrides_to_dict(overrides, example="train.iters=50")


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load YAML ``path`` (None = defaults), apply overrides, check types and static consistency."""
    data: dict[str, Any] = {}
    if path is not None:
        from megatron_ds_suite.configs_lookup import find_config

        p = find_config(path)  # an existing file, else a bundled default config of that name
        data = read_yaml(p, "config file", " (see configs/ for examples; `megatron-ds-configs list` shows the "
                                           "bundled ones)")
    cfg = build_dataclass(Config, with_overrides(data, overrides))
    validate_static(cfg)
    validate_data_source(cfg)
    return cfg


def read_old_keys(data: dict[str, Any], newest: bool = False) -> dict[str, Any]:
    """``data`` with the old ``model.activation_checkpointing`` read into ``model.recompute``. In one source
    (a file, a saved config) the two must agree; ``newest``: the old key was the last one set (a command-line
    override on top of a file) and wins."""
    model = data.get("model")
    if not isinstance(model, dict) or "activation_checkpointing" not in model:
        return data
    model = dict(model)
    old = model.pop("activation_checkpointing")
    if old is not None:  # None: a config saved since the rename
        if not any(old == k and type(old) is type(k) for k in OLD_RECOMPUTE_KEY):
            raise ConfigError(f"model.activation_checkpointing: {old!r} is not true, false or auto (the old key; "
                              f"use model.recompute: none | selective | full | auto)")
        mapped = OLD_RECOMPUTE_KEY[old]
        if not newest and model.get("recompute", mapped) != mapped:
            raise ConfigError(f"model.activation_checkpointing={str(old).lower()} (the old key) disagrees with "
                              f"model.recompute={model['recompute']}: set only model.recompute (none | selective | "
                              f"full | auto)")
        model["recompute"] = mapped
    return {**data, "model": model}


def with_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """``data`` (a config file's mapping) with the ``section.key=value`` overrides applied in order, the old
    recompute key read at each step (:func:`read_old_keys`): an override wins over the file in either spelling."""
    data = read_old_keys(data)
    for item in overrides or []:
        data = read_old_keys(apply_overrides(data, [item], example="train.iters=50"), newest=True)
    return data


def validate_data_source(cfg: Config) -> None:
    """A training run needs data; a saved config need not have any (an imported checkpoint has none)."""
    if cfg.data.corpus is None and not cfg.data.text_files and not cfg.data.prefixes:
        raise ConfigError("data: set data.corpus (a directory from `python -m data_pipeline build`), "
                          "data.text_files or data.prefixes")


def config_from_dict(data: dict[str, Any]) -> Config:
    cfg = build_dataclass(Config, read_old_keys(data))
    validate_static(cfg)
    return cfg


def validate_document_options(cfg: Config) -> None:
    """data.reset_position_ids / reset_attention_mask / eod_mask_loss and model.sliding_window (the masks the GPT
    model builds before its layers): GPT without pipeline parallelism."""
    if cfg.model.sliding_window is not None and cfg.parallel.pipeline > 1:
        raise ConfigError(f"model.sliding_window={cfg.model.sliding_window} with parallel.pipeline="
                          f"{cfg.parallel.pipeline}: the window's mask does not cross pipeline stages yet; set "
                          f"parallel.pipeline=1 or remove model.sliding_window")
    options = cfg.data.document_options()
    if not options:
        return
    named = ", ".join(f"data.{n}" for n in options)
    if cfg.model.arch == "bert":
        raise ConfigError(f"{named}: packed-document options are for GPT (BERT samples are sentence pairs with "
                          f"their own padding mask); remove them or set model.arch=gpt")
    if cfg.parallel.pipeline > 1:
        raise ConfigError(f"{named} with parallel.pipeline={cfg.parallel.pipeline}: the document mask and positions "
                          f"do not cross pipeline stages yet; set parallel.pipeline=1 or remove them")


def validate_static(cfg: Config) -> None:  # noqa: C901
    """Checks that need no process group: sizes, divisibility, ranges (the ranges declared on the fields,
    :func:`check_ranges`, first: a config an importer built in Python has not been through the loader)."""
    check_ranges(cfg)
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optimizer
    for name, v in [("model.num_layers", m.num_layers), ("model.hidden_size", m.hidden_size),
                    ("model.num_attention_heads", m.num_attention_heads), ("model.seq_length", m.seq_length),
                    ("parallel.tensor", p.tensor), ("parallel.pipeline", p.pipeline), ("parallel.context", p.context),
                    ("train.micro_batch_size", t.micro_batch_size), ("train.global_batch_size", t.global_batch_size),
                    ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by)]:
        if v < 1:
            raise ConfigError(f"{name} must be >= 1, got {v}")
    if t.iters < 0:
        raise ConfigError(f"train.iters must be >= 0, got {t.iters}")
    for name, zero in (("save_interval", "save only at the end"), ("eval_interval", "validate only at the end"),
                       ("log_interval", "log no step lines"), ("eval_iters", "no validation batches")):
        if getattr(t, name) < 0:  # `it % -1 == 0`: a negative interval would save/validate/log at every step
            raise ConfigError(f"train.{name} must be >= 0 (0 = {zero}), got {getattr(t, name)}")
    if t.keep_last < 1:
        raise ConfigError(f"train.keep_last must be >= 1 (the newest checkpoint is always kept), got {t.keep_last}")
    validate_shape(m.shape(), p.tensor, p.pipeline, p.sequence_parallel)  # the planner's rules too
    validate_model_options(m)
    validate_document_options(cfg)
    validate_eval(cfg.eval, cfg.model, cfg.parallel)
    validate_zero(p)
    validate_universal_load(t.load_universal, t.init_from, p)
    validate_pipeline_schedule(p, m)
    validate_context(p, m)
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"optimizer: need 0 <= min_lr <= lr and lr > 0 (got lr={o.lr}, min_lr={o.min_lr})")
    decay = o.decay_iters if o.decay_iters is not None else t.iters
    if o.warmup_iters > max(decay, 0):
        raise ConfigError(f"optimizer.warmup_iters={o.warmup_iters} exceeds the decay length {decay}")
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not a multiple of "
                          f"train.micro_batch_size={t.micro_batch_size}")
    if sum([cfg.data.corpus is not None, bool(cfg.data.text_files), bool(cfg.data.prefixes)]) > 1:
        raise ConfigError("data: set one of data.corpus, data.text_files or data.prefixes, not several")
    if cfg.data.prefixes and m.arch == "bert":
        raise ConfigError("data.prefixes (blended .bin/.idx datasets) is for GPT; BERT needs data.corpus")
    if cfg.run.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None and importlib.util.find_spec("tensorboardX") is None:
            raise ConfigError("run.tensorboard=true needs the tensorboard package: pip install tensorboard")
    if cfg.run.wandb.enabled:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("run.wandb.enabled=true needs the wandb package: pip install 'megatron-ds-suite[tracking]'")
    from training.ds_schema import DS_FIXED
    from training.tracking import check_passthrough

    check_passthrough(cfg.deepspeed, DS_FIXED)
    try:
        parts = [float(x) for x in cfg.data.split.split(",")]
        assert len(parts) == 3 and all(x >= 0 for x in parts) and sum(parts) > 0
    except (ValueError, AssertionError):
        raise ConfigError(f"data.split={cfg.data.split!r} must be three non-negative numbers like '969,30,1'") from None
    if cfg.data.split_convention == "megatron_core" and cfg.data.separate_last_epoch is False:
        raise ConfigError("data.separate_last_epoch=false with data.split_convention=megatron_core: Megatron-Core "
                          "always shuffles a short last epoch apart; remove data.separate_last_epoch")
    if parts[0] == 0 and cfg.train.iters > 0:
        raise ConfigError(f"data.split={cfg.data.split!r} gives the training set no documents: make its first "
                          f"number positive, e.g. '969,30,1'")


# --------------------------------------------------------------------------------------------------
# Derived values
# --------------------------------------------------------------------------------------------------
def grad_accumulation(global_batch: int, micro_batch: int, dp: int) -> int:
    """Micro-batches per step on each DP rank; raises ConfigError when the global batch does not split."""
    if global_batch % (micro_batch * dp):
        raise ConfigError(f"train.global_batch_size={global_batch} is not divisible by micro_batch_size x "
                          f"DP = {micro_batch} x {dp}: change one of them")
    return global_batch // (micro_batch * dp)


def resolve_dtype(cfg: Config, on_gpu: bool) -> str:
    d = cfg.precision.dtype
    if d == "auto":
        return "fp16" if on_gpu else "fp32"
    if d == "fp16" and not on_gpu and not cfg.precision.allow_fp16_on_cpu:
        raise ConfigError("precision.dtype=fp16 on CPU needs precision.allow_fp16_on_cpu=true "
                          "(slow; meant for tests) or use bf16/fp32")
    return d
