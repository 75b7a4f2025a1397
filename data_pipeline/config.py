"""Typed configuration of the corpus builder, loaded from YAML with ``a.b=value`` overrides.

Every key has a type; an unknown key, a wrong type, a value out of range or a missing input path
raises :class:`ConfigError` with one line saying what is wrong and how to fix it, before any work.
Reading, overrides and key/type checks are the suite's one loader (:mod:`megatron_ds_suite.core.config`);
this module holds the dataclasses and the value checks of the corpus builder.
"""
from __future__ import annotations

import dataclasses
import glob
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from megatron_ds_suite.core.config import AtLeastOne, Fraction, NonNegative, Positive, build_dataclass
from megatron_ds_suite.core.config_yaml import apply_overrides, read_yaml
from megatron_ds_suite.core.errors import ConfigError
from megatron_ds_suite.core.program import stderr_is_terminal


@dataclass
class SourceConfig:
    """One input. ``type``: jsonl (plain or .gz) | text | parquet | hf | default.

    ``path`` is a file, a directory (all matching files, sorted) or a glob; for ``hf`` a dataset
    name on the Hub or a local path (``save_to_disk`` folder or a loadable script/data folder).
    """

    type: str = "jsonl"
    """The reader: jsonl (plain or .gz), text, parquet, hf (a Hugging Face dataset) or default (the Python
    documentation text shipped with the interpreter)."""
    path: str | None = None
    """A file, a directory (all matching files, sorted) or a glob; for ``hf`` a dataset name on the Hub or a local
    path; relative to the config file."""
    text_field: str = "text"
    """jsonl/parquet/hf: the field that holds a record's text."""
    id_field: str | None = None
    """The field that holds the user's id of a record (kept as ``id`` in ``documents.jsonl``); None: the record's
    provenance is its id."""
    text_mode: str = "file"
    """text sources: ``file`` = one document per file, ``blocks`` = one per blank-line-separated block."""
    hf_name: str | None = None
    """hf: the dataset's configuration name."""
    hf_split: str = "train"
    """hf: the split read."""
    limit: int | None = None
    """Read at most this many records from this source (None: all)."""


@dataclass
class CleanConfig:
    ftfy: bool = True
    """Repair mojibake and other Unicode damage with ftfy (Megatron's default fixers) before anything else."""
    normalize_whitespace: bool = True
    """Collapse runs of spaces and blank lines, strip each line's ends."""
    max_doc_bytes: int = 8_000_000
    """A record larger than this many UTF-8 bytes is rejected as ``too_large``."""


@dataclass
class TokenizerConfig:
    """``type``: sentencepiece (train on the cleaned corpus) | sentencepiece_model (load ``model_file``)
    | gpt2 (load ``vocab_file`` + ``merges_file``) | wordpiece (a BERT ``vocab.txt`` as ``vocab_file``,
    ``lowercase``) | hf (a ``tokenizer.json`` as ``model_file``)."""

    type: str = "sentencepiece"
    """sentencepiece (trained here) | sentencepiece_model | gpt2 | wordpiece | hf (class docstring)."""
    vocab_size: int = 8000
    """sentencepiece: the vocabulary size trained."""
    flavor: str = "gpt"
    """gpt: BPE with ``<|endoftext|>``; bert: a vocabulary with [CLS]/[SEP]/[MASK]/[PAD]."""
    model_file: str | None = None
    """sentencepiece_model: the ``.model``; hf: the ``tokenizer.json``."""
    vocab_file: str | None = None
    """gpt2: ``vocab.json``; wordpiece: ``vocab.txt``."""
    merges_file: str | None = None
    """gpt2: ``merges.txt``."""
    train_max_docs: Annotated[int, AtLeastOne] = 200_000
    """sentencepiece training sample: the first N cleaned documents."""
    num_threads: int = 16
    """SentencePiece training threads. A setting, not the machine's core count: the learned pieces do not depend on it,
    but SentencePiece records it in the .model file, whose bytes (and sha256, in the manifest) would then differ
    between machines; more threads than cores only costs scheduling (16 on 2 cores: as fast as 2, 1.7x faster than
    1)."""
    lowercase: bool = True
    """wordpiece: lower-case and strip accents (uncased BERT vocabularies)."""


@dataclass
class LengthConfig:
    min_tokens: int = 128
    """Documents with fewer tokens are dropped (counted as ``too_short``)."""
    count_eod: bool = True
    """Count the appended ``<|endoftext|>`` too, as Megatron does before comparing with 128 (dedup.md §1.1)."""


@dataclass
class DedupConfig:
    enabled: bool = True
    """Remove duplicates (exact, then near-duplicates); false: the stage passes every document on."""
    threshold: float = 0.7
    """Exact Jaccard of shingle sets at or above which two documents are duplicates."""
    num_perm: int = 128
    """MinHash permutations per signature."""
    shingle_size: int = 5
    """Units per shingle (n of the n-grams)."""
    shingle_unit: str = "word"
    """word: lower-cased ``\\w+`` words; char: raw characters (Megatron's char 5-grams)."""
    bands: int | None = None
    """LSH bands; None: datasketch's ``_optimal_param(threshold, num_perm, *lsh_weights)``."""
    rows: int | None = None
    """LSH rows per band; None: with ``bands``, from ``lsh_weights``."""
    lsh_weights: list[Annotated[float, Fraction]] = field(default_factory=lambda: [0.1, 0.9])
    """(false-positive, false-negative) weights of the band/row choice."""
    seed: Annotated[int, NonNegative] = 1
    """Seed of the MinHash permutations."""
    chunk_size: int = 1000
    """Documents per signature chunk (unit of parallelism and of resume)."""
    verify_block_docs: int = 20000
    """Most distinct documents whose shingle sets a verification task loads at once."""
    exact: bool = True
    """Exact dedup first (hash of the cleaned text, counted in stats), then MinHash on the survivors, as NeMo Curator
    orders them."""
    sharded: bool = True
    """Retired (issue 39): the stage always runs its steps as worker tasks over files (the driver holds no signature or
    bucket); only true is accepted."""


@dataclass
class DatasetConfig:
    gpt: bool = True
    """Write the GPT indexed dataset: one item per document, EOD appended."""
    bert: bool = False
    """Write the BERT indexed dataset: one item per sentence, ``end_document()`` per document."""
    gpt_prefix: str = "gpt_text_document"
    """File name (inside ``output_dir``) of the GPT dataset's ``.bin``/``.idx``."""
    bert_prefix: str = "bert_text_sentence"
    """File name (inside ``output_dir``) of the BERT dataset's ``.bin``/``.idx``."""
    tokenize_batch: Annotated[int, AtLeastOne] = 256
    """Documents per ``encode_batch`` call."""


@dataclass
class DecontaminateConfig:
    """Export drops every kept document that shares a word ``ngram``-gram with an evaluation set
    (``data_pipeline/overlap.py``); counted in stats.json, listed in ``contaminated.jsonl``."""

    against: list[str] = field(default_factory=list)
    """NAME=FILE items (jsonl with ``text``, or text lines); [] = off."""
    ngram: int = 13
    """The n of the shared word n-grams (13: GPT-3's and Megatron's)."""


@dataclass
class RayConfig:
    """``executor: ray`` settings (``data_pipeline/ray_executor.py``)."""

    address: str = "auto"
    """An existing cluster: ``auto`` (RAY_ADDRESS or the local head) or ``host:port``."""
    num_cpus_per_task: Annotated[float, Positive] = 1.0
    """CPUs Ray reserves per task."""
    max_retries: Annotated[int, NonNegative] = 3
    """A task whose worker dies is rerun this many times (stage functions are idempotent)."""
    lsh_partitions: Annotated[int, NonNegative] = 0
    """The least number of dedup partitions and verification ranges; 0 = 2 x the cluster's CPUs."""


@dataclass
class BuildConfig:
    output_dir: str = "runs/corpus"
    """Where the corpus and its ``work/`` folder go (relative to the config file)."""
    sources: list[SourceConfig] = field(default_factory=list)
    """The inputs, read in order (input indices run across them)."""
    workers: int = 0
    """Worker processes of the local executor; 0: all cores."""
    shard_size: int = 2000
    """Input records per ingest shard (the unit of parallelism and of resume)."""
    seed: Annotated[int, NonNegative] = 1234
    """Seed of SentencePiece training."""
    progress: bool | None = None
    """Progress bars on stderr: true/false, or null (the default) = only when stderr is a terminal (a bar
    redrawn with carriage returns is noise in a Slurm, CI or piped log)."""
    clean: CleanConfig = field(default_factory=CleanConfig)
    """Cleaning (stage ingest)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer trained or loaded (stage tokenizer)."""
    length: LengthConfig = field(default_factory=LengthConfig)
    """The length filter (stage filter)."""
    dedup: DedupConfig = field(default_factory=DedupConfig)
    """Exact and near-duplicate removal (stage dedup)."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """The indexed datasets written (stage export)."""
    decontaminate: DecontaminateConfig = field(default_factory=DecontaminateConfig)
    """Evaluation-set overlap removal (stage export)."""
    executor: str = "local"
    """Where tasks run: local (forked processes on this machine) or ray (tasks on a Ray cluster, ``ray.address``);
    chosen once per build (``data_pipeline/executor.py``)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """``executor: ray`` settings."""
    base_dir: str = "."
    """Directory that relative paths in the config are resolved against (set by ``load_config``)."""

    @property
    def num_workers(self) -> int:
        return self.workers if self.workers > 0 else (os.cpu_count() or 1)

    def resolve(self, p: str) -> Path:
        path = Path(os.path.expanduser(p))
        return path if path.is_absolute() else Path(self.base_dir) / path

    @property
    def out(self) -> Path:
        return self.resolve(self.output_dir)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_ENUMS = {
    "sources.type": ("jsonl", "text", "parquet", "hf", "default"),
    "sources.text_mode": ("file", "blocks"),
    "tokenizer.type": ("sentencepiece", "sentencepiece_model", "gpt2", "wordpiece", "hf"),
    "tokenizer.flavor": ("gpt", "bert"),
    "dedup.shingle_unit": ("word", "char"),
    "executor": ("local", "ray"),
}


def _validate(cfg: BuildConfig) -> None:  # noqa: C901
    def enum(key: str, value: str) -> None:
        allowed = _ENUMS[key]
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")

    if not cfg.sources:
        raise ConfigError("sources is empty: add at least one source, e.g. sources: [{type: default}]")
    for i, s in enumerate(cfg.sources):
        enum("sources.type", s.type)
        enum("sources.text_mode", s.text_mode)
        if s.type != "default":
            if not s.path:
                raise ConfigError(f"sources[{i}].path is required for type {s.type}")
            if s.type != "hf" or _looks_local(s.path):
                p = cfg.resolve(s.path)
                if not p.exists() and not _glob(p):
                    raise ConfigError(f"sources[{i}].path: input not found: {p}")
        if s.limit is not None and s.limit < 0:
            raise ConfigError(f"sources[{i}].limit must be >= 0, got {s.limit}")
        folder, depth = _source_folder(cfg, s)
        out = cfg.out.resolve()
        inside = folder is not None and (out == folder or folder in out.parents)
        # a glob without `**` matches files exactly `depth` folders below its fixed part: an output folder at that
        # depth or deeper holds no file it can match (`data/*.jsonl` with output_dir data/out is fine)
        if inside and (depth is None or len(out.relative_to(folder).parts) < depth):
            raise ConfigError(f"output_dir {cfg.out} lies inside sources[{i}].path {s.path}, whose folders are read "
                              f"whole: a later build would read this build's own files (documents.jsonl, work/...) as "
                              f"input; choose an output_dir outside the source folders")
    enum("tokenizer.type", cfg.tokenizer.type)
    enum("tokenizer.flavor", cfg.tokenizer.flavor)
    enum("dedup.shingle_unit", cfg.dedup.shingle_unit)
    enum("executor", cfg.executor)
    if not cfg.dedup.sharded:
        raise ConfigError("dedup.sharded=false (the single-driver dedup path) was retired: the stage always runs "
                          "its steps as worker tasks; remove the key (or set it to true)")
    t = cfg.tokenizer
    need = {"sentencepiece_model": ["model_file"], "gpt2": ["vocab_file", "merges_file"], "wordpiece": ["vocab_file"],
            "hf": ["model_file"]}.get(t.type, [])
    for k in need:
        v = getattr(t, k)
        if not v:
            raise ConfigError(f"tokenizer.{k} is required for tokenizer.type={t.type}")
        if not cfg.resolve(v).is_file():
            raise ConfigError(f"tokenizer.{k}: file not found: {cfg.resolve(v)}")
    if t.type == "gpt2" and cfg.dataset.bert:
        raise ConfigError("dataset.bert needs a BERT vocabulary: use tokenizer.type=sentencepiece with flavor=bert")
    if cfg.dataset.bert and t.flavor != "bert" and t.type == "sentencepiece":
        raise ConfigError("dataset.bert=true needs tokenizer.flavor=bert (a vocabulary with [CLS]/[SEP]/[MASK])")
    if t.vocab_size < 100:
        raise ConfigError(f"tokenizer.vocab_size must be >= 100, got {t.vocab_size}")
    if t.num_threads < 1:
        raise ConfigError(f"tokenizer.num_threads must be >= 1, got {t.num_threads}")
    d = cfg.dedup
    if not 0.0 < d.threshold <= 1.0:
        raise ConfigError(f"dedup.threshold must be in (0, 1], got {d.threshold}")
    if d.num_perm < 2 or d.shingle_size < 1 or d.chunk_size < 1 or d.verify_block_docs < 2:
        raise ConfigError("dedup.num_perm >= 2, dedup.shingle_size >= 1, dedup.chunk_size >= 1, "
                          "dedup.verify_block_docs >= 2 are required")
    if (d.bands is None) != (d.rows is None):
        raise ConfigError("dedup.bands and dedup.rows must be given together (or both null)")
    if d.bands is not None and (d.bands < 2 or d.rows < 1 or d.bands * d.rows > d.num_perm):
        raise ConfigError(f"dedup.bands*rows must be <= num_perm={d.num_perm} with bands >= 2; "
                          f"got {d.bands}x{d.rows}")
    if len(d.lsh_weights) != 2 or abs(sum(d.lsh_weights) - 1.0) > 1e-9:
        raise ConfigError(f"dedup.lsh_weights must be two numbers summing to 1, got {d.lsh_weights}")
    if cfg.length.min_tokens < 0 or cfg.clean.max_doc_bytes < 1 or cfg.shard_size < 1:
        raise ConfigError("length.min_tokens >= 0, clean.max_doc_bytes >= 1 and shard_size >= 1 are required")
    if not (cfg.dataset.gpt or cfg.dataset.bert):
        raise ConfigError("dataset.gpt and dataset.bert are both false: enable at least one")
    for key in ("gpt_prefix", "bert_prefix"):  # the .bin/.idx are written as output_dir/<prefix>.{bin,idx}
        name = getattr(cfg.dataset, key)
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ConfigError(f"dataset.{key} must be a file name inside output_dir (no '/', '\\' or '..'), "
                              f"got {name!r}")
    if cfg.dataset.gpt and cfg.dataset.bert and cfg.dataset.gpt_prefix == cfg.dataset.bert_prefix:
        raise ConfigError(f"dataset.gpt_prefix and dataset.bert_prefix are both {cfg.dataset.gpt_prefix!r}: the "
                          f"two datasets would overwrite each other; give them different names")
    dc = cfg.decontaminate
    if dc.ngram < 1:
        raise ConfigError(f"decontaminate.ngram must be >= 1, got {dc.ngram}")
    for item in dc.against:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"decontaminate.against item {item!r} must look like NAME=FILE")
        if not cfg.resolve(path).is_file():
            raise ConfigError(f"decontaminate.against {name}: file not found: {cfg.resolve(path)}")


def _source_folder(cfg: BuildConfig, s: SourceConfig) -> tuple[Path | None, int | None]:
    """(the folder a local source reads files under, resolved; how many levels below it a glob without ``**``
    reaches, None for any depth): a directory is read whole, a glob from its fixed leading part. (None, None) for a
    single file, the built-in corpus or a Hub name."""
    if not s.path or s.type == "default" or (s.type == "hf" and not _looks_local(s.path)):
        return None, None
    p = cfg.resolve(s.path)
    if p.is_dir():
        return p.resolve(), None
    if p.exists():
        return None, None
    fixed = list(itertools.takewhile(lambda x: not glob.has_magic(x), p.parts))
    if not fixed or len(fixed) == len(p.parts):
        return None, None
    rest = p.parts[len(fixed):]
    return Path(*fixed).resolve(), (None if "**" in rest else len(rest))


def _looks_local(p: str) -> bool:
    return p.startswith((".", "/", "~")) or Path(p).exists()


def _glob(p: Path) -> list[Path]:
    return sorted(Path(p.anchor or ".").glob(str(p.relative_to(p.anchor)) if p.is_absolute() else str(p)))


def config_from_dict(data: dict[str, Any], base_dir: str | Path = ".",
                     overrides: list[str] | None = None) -> BuildConfig:
    """Build and validate a :class:`BuildConfig` from a plain mapping (YAML content)."""
    if data and not isinstance(data, dict):
        raise ConfigError(f"the config must be a mapping at top level, got {type(data).__name__}")
    data = apply_overrides(data or {}, overrides, example="dedup.threshold=0.8")
    data.setdefault("base_dir", str(base_dir))
    cfg = build_dataclass(BuildConfig, data)
    _validate(cfg)
    if cfg.progress is None:
        cfg.progress = stderr_is_terminal()
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> BuildConfig:
    """Load a YAML config. Relative paths inside it (inputs, output_dir, tokenizer files) resolve
    against the current working directory, like paths on the command line."""
    from megatron_ds_suite.configs_lookup import find_config

    path = find_config(path)  # an existing file, else a bundled default config of that name
    data = read_yaml(path, "config file", " (`megatron-ds-configs list` shows the bundled ones)")
    return config_from_dict(data, base_dir=".", overrides=overrides)
