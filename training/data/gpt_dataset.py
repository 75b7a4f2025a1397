"""Megatron's GPT dataset (``megatron/data/gpt2_dataset.py`` + ``helpers.build_sample_idx``), vectorised.

Given the items (documents) of one split, a sample count S and a sequence length L:

* ``tokens_per_epoch`` T = sum of the documents' sizes; epochs E = smallest E with
  ``(E*T - 1) // L >= S``.
* ``doc_idx`` (int32, E*D): the split's document ids repeated E times, shuffled *together* by
  ``np.random.RandomState(seed)`` (Megatron 2020 semantics, the default).
* ``sample_idx`` (int32 [M+1, 2], M = (E*T - 1) // L): concatenating the documents in ``doc_idx`` order
  gives a token stream; sample k covers stream positions ``[k*L, k*L + L]`` inclusive (L+1 tokens, one
  token of overlap with sample k+1).  Row k is ``(position in doc_idx, offset in that document)`` of
  stream position ``k*L``: the document containing that token.  Row 0 is ``(0, 0)``.  This equals the C++
  walk in Megatron's ``build_sample_idx``, computed with one ``searchsorted`` instead of a loop.
* ``shuffle_idx`` (uint32, or int64 when M >= 2**32 - 1): ``arange(M)`` shuffled by the *same* RNG,
  after ``doc_idx``.
* ``separate_last_epoch=True`` (``data.separate_last_epoch``; Megatron 2021+ ``gpt_dataset.py``, HEAD
  ``megatron/core/datasets/gpt_dataset.py``): when E > 1 and the last epoch supplies fewer than
  ``int(0.8 * ((T - 1) // L))`` of the S samples, that short epoch is kept apart, so its documents and
  samples are not mixed into the first E - 1 epochs: ``doc_idx`` = shuffle(E - 1 epochs) ++ shuffle(1
  epoch), and ``shuffle_idx`` = shuffle(arange(M1)) ++ shuffle(arange(M1, M)) with
  ``M1 = ((E - 1) * T - 1) // L`` (all draws from the one RNG, in that order). The first S samples then
  repeat each document at most E - 1 times plus a partial pass, instead of drawing a random E-th copy
  of some documents early.

``dataset[i]`` = the L+1 tokens of sample ``shuffle_idx[i]`` as int64, crossing document boundaries
(documents are separated only by the EOD the corpus builder appended).  ``len(dataset)`` = M >= S (as in
Megatron, the whole last epoch is indexed; a sampler takes the first S).

Index maps are cached as ``.npy`` files named
``{data_prefix_name}_{name}_indexmap_{S}ns_{L}sl_{seed}s_{digest}_{doc|sample|shuffle}_idx.npy``
(Megatron's name plus ``digest``, and ``_sle`` when the last epoch is separated, 10 hex chars of a hash of the split's document ids and the dataset's
item count and token count, so a changed split or rebuilt corpus never reuses a stale map).  They are
written to temporary names then renamed (``shuffle`` last: its presence means the set is complete) and
reloaded with ``mmap_mode='r'`` and checked (:func:`index_maps_problem`): a damaged set (a file zeroed by a
crash or a copy) is rebuilt with one warning instead of being used.  Index building is deterministic, so two processes that build at the
same time write identical files and the rename is harmless; no barrier is needed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import numpy as np
import torch

from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.errors import SuiteError
from megatron_ds_suite.core.indexed_dataset import MMapIndexedDataset
from training.data.split_convention import check_convention, core_split_boundaries

logger = logging.getLogger(__name__)

MAX_INDEX_ENTRIES = 2**31 - 1  # doc_idx longer than this: the split is far too small for num_samples


class GPTDatasetError(SuiteError):
    """Bad split string, empty split or impossible sample request (one clear line)."""


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"969/30/1"``) -> three non-negative weights normalised to sum 1 (missing -> 0)."""
    weights = raw_split(split)
    total = sum(weights)
    return [w / total for w in weights]


def raw_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"969/30/1"``) -> the three numbers (missing -> 0), checked: non-negative, sum > 0."""
    sep = "," if "," in split else "/"
    try:
        weights = [float(s) for s in split.split(sep) if s.strip() != ""]
    except ValueError:
        raise GPTDatasetError(f"split {split!r} must be up to 3 numbers like '969,30,1'") from None
    if not 1 <= len(weights) <= 3 or any(w < 0 or not np.isfinite(w) for w in weights):
        raise GPTDatasetError(f"split {split!r} must be 1 to 3 non-negative numbers like '969,30,1'")
    weights += [0.0] * (3 - len(weights))
    if sum(weights) <= 0:
        raise GPTDatasetError(f"split {split!r} sums to 0")
    return weights


def split_boundaries(split: str, size: int, convention: str = "megatron_lm") -> list[int]:
    """``[0, a, b, size]`` cut points over ``size`` documents: with ``convention="megatron_core"`` Megatron-Core's
    rounded cumulative boundaries (:mod:`training.data.split_convention`), else Megatron's
    ``get_train_valid_test_split_`` (2021):

    Each part gets ``round(weight * size)`` documents; the rounding excess is taken off every boundary.
    Clamped to a non-decreasing sequence in ``[0, size]`` (Megatron can go negative for tiny sizes).
    """
    if check_convention(convention) == "megatron_core":
        return core_split_boundaries(raw_split(split), size)
    weights = parse_split(split)
    idx = [0]
    for w in weights:
        idx.append(idx[-1] + int(round(w * float(size))))
    diff = idx[-1] - size
    for k in range(1, len(idx)):
        idx[k] -= diff
    idx = [min(max(v, 0), size) for v in idx]
    for k in range(1, len(idx)):
        idx[k] = max(idx[k], idx[k - 1])
    assert idx[0] == 0 and idx[-1] == size
    return idx


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest E with ``(E*T - 1) // L >= S`` (closed form of Megatron's loop)."""
    if tokens_per_epoch <= 0:
        raise GPTDatasetError("the split has no tokens")
    # (E*T - 1) // L >= S  <=>  E*T - 1 >= S*L  <=>  E >= (S*L + 1) / T
    need = num_samples * seq_length + 1
    return max(1, -(-need // tokens_per_epoch))


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    """Documents repeated ``num_epochs`` times, shuffled in place by ``rng`` (int32 as Megatron)."""
    dtype = np.int32 if (len(documents) == 0 or int(documents.max()) < 2**31) else np.int64
    doc_idx = np.tile(documents.astype(dtype), num_epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int) -> np.ndarray:
    """``[M+1, 2]`` (doc_idx position, offset) of stream positions ``k*seq_length``, ``M = (E*T-1)//L``.

    Vectorised equivalent of Megatron's C++ ``build_sample_idx``: the row for position p is the document
    ``i`` with ``cum_end[i-1] <= p < cum_end[i]`` (``searchsorted(cum_end, p, 'right')``: empty documents
    are skipped and a sample that ends on a document's last token stays in that document).
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    doc_lengths = sizes[doc_idx].astype(np.int64)
    cum_end = np.cumsum(doc_lengths)
    pos = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(cum_end, pos, side="right")
    offset = pos - (cum_end[doc_pos] - doc_lengths[doc_pos])
    doc_pos[0], offset[0] = 0, 0
    big = max(int(doc_pos[-1]), int(offset.max(initial=0))) >= 2**31
    out = np.empty((num_samples + 1, 2), dtype=np.int64 if big else np.int32)
    out[:, 0] = doc_pos
    out[:, 1] = offset
    return out


def build_shuffle_idx(size: int, rng: np.random.RandomState, first: int | None = None) -> np.ndarray:
    """``arange(size)`` shuffled by ``rng``; uint32 unless too large (Megatron). With ``first`` < size the
    two ranges ``[0, first)`` and ``[first, size)`` are shuffled separately, in that order (Megatron
    2021 ``_build_shuffle_idx`` for a separated last epoch)."""
    dtype = np.uint32 if size < np.iinfo(np.uint32).max - 1 else np.int64
    first = size if first is None else first
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == size:
        return head
    tail = np.arange(first, size, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate([head, tail])


def separate_last_epoch_samples(tokens_per_epoch: int, seq_length: int, num_samples: int,
                                num_epochs: int) -> int | None:
    """Megatron 2021's rule: the samples of the first E - 1 epochs when the last epoch is to be shuffled
    apart (it supplies fewer than 80 % of an epoch's samples), else None."""
    if num_epochs <= 1:
        return None
    before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return before_last if num_samples - before_last < int(0.80 * per_epoch) else None


def index_maps_problem(doc_idx: np.ndarray, sample_idx: np.ndarray, shuffle_idx: np.ndarray, documents: np.ndarray,
                       sizes: np.ndarray, num_epochs: int, seq_length: int, num_samples: int,
                       first_epochs_samples: int | None) -> str | None:
    """What is wrong with loaded index maps (e.g. a cache file zeroed by a crash or a copy), or None. One
    vectorised pass: doc_idx holds each document ``num_epochs`` times, row k of sample_idx points at stream
    token ``k * seq_length``, shuffle_idx is a permutation (range and sum) of its samples."""
    if doc_idx.ndim != 1 or len(doc_idx) != num_epochs * len(documents):
        return f"doc_idx has shape {doc_idx.shape}, expected ({num_epochs * len(documents)},)"
    lo, hi = int(documents.min()), int(documents.max())
    if len(doc_idx) and (int(doc_idx.min()) < lo or int(doc_idx.max()) > hi):
        return "doc_idx names documents outside the split"
    if not np.array_equal(np.bincount(np.asarray(doc_idx, dtype=np.int64) - lo, minlength=hi - lo + 1),
                          np.bincount(documents - lo, minlength=hi - lo + 1) * num_epochs):
        return f"doc_idx does not hold every document {num_epochs} time(s)"
    if sample_idx.ndim != 2 or sample_idx.shape[1] != 2 or sample_idx.shape[0] < 2:
        return f"sample_idx has shape {sample_idx.shape}"
    pos, off = np.asarray(sample_idx[:, 0], dtype=np.int64), np.asarray(sample_idx[:, 1], dtype=np.int64)
    if int(pos.min()) < 0 or int(pos.max()) >= len(doc_idx) or int(off.min()) < 0:
        return "sample_idx points outside doc_idx"
    lengths = sizes[doc_idx].astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    if not np.array_equal(starts[pos] + off, np.arange(len(pos), dtype=np.int64) * seq_length):
        return "sample_idx rows do not step by seq_length tokens"
    m = len(pos) - 1
    if shuffle_idx.ndim != 1 or len(shuffle_idx) != m or m < num_samples:
        return f"shuffle_idx has shape {shuffle_idx.shape}, expected ({m},) and at least {num_samples}"
    sh = np.asarray(shuffle_idx, dtype=np.int64)
    head = m if first_epochs_samples is None else first_epochs_samples
    for part, start, stop in ((sh[:head], 0, head), (sh[head:], head, m)):
        if len(part) and (int(part.min()) != start or int(part.max()) != stop - 1
                          or int(part.sum()) != (start + stop - 1) * (stop - start) // 2):
            return "shuffle_idx is not a permutation of its samples"
    return None


def _atomic_save(path: Path, arr: np.ndarray) -> None:
    with atomic.atomic_open(path, "wb") as f:
        np.save(f, arr, allow_pickle=False)


class GPTDataset(torch.utils.data.Dataset):
    """Fixed-length GPT samples over the items ``documents`` of ``indexed`` (see module docstring).

    ``self[i]`` -> ``np.ndarray`` int64 of shape ``[seq_length + 1]`` (inputs ``[:-1]``, labels ``[1:]``).
    ``built_index`` is True when this instance built the index maps, False when it loaded a cache.
    """

    def __init__(self, name: str, indexed: MMapIndexedDataset, documents: np.ndarray, num_samples: int,
                 seq_length: int, seed: int, cache_dir: Path | None = None,
                 separate_last_epoch: bool = False) -> None:
        self.name = name
        self.indexed = indexed
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.num_samples = int(num_samples)
        documents = np.asarray(documents)
        if self.seq_length < 1:
            raise GPTDatasetError(f"seq_length must be >= 1, got {seq_length}")
        if self.num_samples < 1:
            raise GPTDatasetError(f"num_samples must be >= 1 for the {name!r} split, got {num_samples}")
        if documents.ndim != 1 or len(documents) == 0:
            raise GPTDatasetError(f"the {name!r} split has no documents")
        if not np.issubdtype(documents.dtype, np.integer):
            raise GPTDatasetError(f"documents must be integer item ids, got dtype {documents.dtype}")
        if int(documents.min()) < 0 or int(documents.max()) >= len(indexed):
            raise GPTDatasetError(f"documents of the {name!r} split are outside [0, {len(indexed)})")
        self.documents = documents
        self.tokens_per_epoch = int(indexed.sizes[documents].sum(dtype=np.int64))
        if self.tokens_per_epoch == 0:
            raise GPTDatasetError(f"the {name!r} split ({len(documents)} documents) has 0 tokens")
        self.num_epochs = num_epochs_for(self.tokens_per_epoch, self.seq_length, self.num_samples)
        if self.num_epochs * len(documents) > MAX_INDEX_ENTRIES:
            raise GPTDatasetError(
                f"the {name!r} split has only {self.tokens_per_epoch} tokens: {self.num_samples} samples of "
                f"{self.seq_length} tokens need {self.num_epochs} epochs; use more data or fewer samples"
            )
        # samples of the first E - 1 epochs when the short last epoch is shuffled apart, else None
        self.first_epochs_samples = (separate_last_epoch_samples(self.tokens_per_epoch, self.seq_length,
                                                                 self.num_samples, self.num_epochs)
                                     if separate_last_epoch else None)
        self.built_index = False
        self._paths = self.index_paths(cache_dir)
        self.doc_idx, self.sample_idx, self.shuffle_idx = self._index_maps(self._paths)

    def __getstate__(self) -> dict:
        # DataLoader workers re-open the memory-mapped index files instead of receiving copies.
        return {k: v for k, v in self.__dict__.items() if k not in ("doc_idx", "sample_idx", "shuffle_idx")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.doc_idx, self.sample_idx, self.shuffle_idx = (
            np.load(self._paths[k], mmap_mode="r", allow_pickle=False) for k in ("doc", "sample", "shuffle"))

    def __repr__(self) -> str:
        return (f"GPTDataset({self.name!r}, samples={len(self)}, seq_length={self.seq_length}, seed={self.seed}, "
                f"documents={len(self.documents)}, epochs={self.num_epochs}, prefix={str(self.indexed.prefix)!r})")

    # -- index maps --------------------------------------------------------------------------------
    def _digest(self) -> str:
        h = hashlib.sha1()
        h.update(np.ascontiguousarray(self.documents, dtype=np.int64).tobytes())
        h.update(f"{len(self.indexed)}:{self.indexed.num_tokens}".encode())
        return h.hexdigest()[:10]

    def index_paths(self, cache_dir: Path | None = None) -> dict[str, Path]:
        """The three cache file paths (``doc``, ``sample``, ``shuffle``)."""
        prefix = Path(self.indexed.prefix)
        directory = Path(cache_dir) if cache_dir is not None else prefix.parent
        stem = (f"{prefix.name}_{self.name}_indexmap_{self.num_samples}ns_{self.seq_length}sl_"
                f"{self.seed}s_{self._digest()}{'' if self.first_epochs_samples is None else '_sle'}")
        return {k: directory / f"{stem}_{k}_idx.npy" for k in ("doc", "sample", "shuffle")}

    def _index_maps(self, paths: dict[str, Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if all(p.is_file() for p in paths.values()):
            logger.info("loading cached %s index maps %s", self.name, paths["shuffle"])
            maps, problem = self._load_index_maps(paths)
            if problem is None:
                return maps
            logger.warning("cached %s index maps %s are damaged (%s): rebuilding them", self.name,
                           paths["shuffle"], problem)
        self._build_index_maps(paths)
        maps, problem = self._load_index_maps(paths)
        if problem is not None:
            raise GPTDatasetError(f"index maps {paths['shuffle']} do not read back ({problem}); check the disk")
        return maps

    def _build_index_maps(self, paths: dict[str, Path]) -> None:
        t0 = time.perf_counter()
        rng = np.random.RandomState(self.seed)
        if self.first_epochs_samples is None:
            doc_idx = build_doc_idx(self.documents, self.num_epochs, rng)
        else:  # the short last epoch's documents shuffled apart, after the others
            doc_idx = np.concatenate([build_doc_idx(self.documents, self.num_epochs - 1, rng),
                                      build_doc_idx(self.documents, 1, rng)])
        sample_idx = build_sample_idx(self.indexed.sizes, doc_idx, self.seq_length, self.num_epochs,
                                      self.tokens_per_epoch)
        shuffle_idx = build_shuffle_idx(sample_idx.shape[0] - 1, rng, self.first_epochs_samples)
        paths["doc"].parent.mkdir(parents=True, exist_ok=True)
        _atomic_save(paths["doc"], doc_idx)
        _atomic_save(paths["sample"], sample_idx)
        _atomic_save(paths["shuffle"], shuffle_idx)  # last: marks the set complete
        self.built_index = True
        logger.info(
            "built %s index maps in %.2fs: %d documents x %d epochs, %d samples of %d tokens -> %s",
            self.name, time.perf_counter() - t0, len(self.documents), self.num_epochs,
            sample_idx.shape[0] - 1, self.seq_length, paths["shuffle"].parent / paths["shuffle"].name,
        )

    def _load_index_maps(self, paths: dict[str, Path]):
        """((doc_idx, sample_idx, shuffle_idx), None), or (None, what is wrong) for an unreadable or damaged set."""
        loaded = []
        for k in ("doc", "sample", "shuffle"):
            try:
                loaded.append(np.load(paths[k], mmap_mode="r", allow_pickle=False))
            except (ValueError, OSError, EOFError) as e:
                why = "not a numpy array file" if "pickle" in str(e) or "magic" in str(e) else str(e)[:80]
                return None, f"{paths[k].name}: {why}"
        problem = index_maps_problem(*loaded, self.documents, self.indexed.sizes, self.num_epochs, self.seq_length,
                                     self.num_samples, self.first_epochs_samples)
        return (None, problem) if problem else (tuple(loaded), None)

    # -- samples -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx: int) -> np.ndarray:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for {self.name!r} dataset of {n} samples")
        j = int(self.shuffle_idx[idx])
        doc_f, off_f = (int(v) for v in self.sample_idx[j])
        doc_l, off_l = (int(v) for v in self.sample_idx[j + 1])
        get = self.indexed.get
        if doc_f == doc_l:
            sample = get(int(self.doc_idx[doc_f]), offset=off_f, length=off_l - off_f + 1)
        else:
            parts = [get(int(self.doc_idx[doc_f]), offset=off_f)]
            for k in range(doc_f + 1, doc_l):
                parts.append(get(int(self.doc_idx[k])))
            parts.append(get(int(self.doc_idx[doc_l]), length=off_l + 1))
            sample = np.concatenate(parts)
        out = np.asarray(sample, dtype=np.int64)
        assert out.shape[0] == self.seq_length + 1, (out.shape, self.seq_length)
        return out


def split_documents(indexed: MMapIndexedDataset, split: str, convention: str = "megatron_lm") -> list[np.ndarray]:
    """Item ids of the train/valid/test splits: contiguous ranges of *documents* (``doc_idx``), or of items with
    ``convention="megatron_core"`` (its GPT split); the same for a GPT corpus (one item per document).
    """
    if check_convention(convention) == "megatron_core":
        bounds = split_boundaries(split, len(indexed), convention)
        return [np.arange(bounds[k], bounds[k + 1], dtype=np.int64) for k in range(3)]
    bounds = split_boundaries(split, indexed.num_documents)
    doc_idx = indexed.doc_idx
    return [np.arange(int(doc_idx[bounds[k]]), int(doc_idx[bounds[k + 1]]), dtype=np.int64) for k in range(3)]


def build_gpt_datasets(prefix: str | Path, split: str, num_samples: tuple[int, int, int], seq_length: int,
                       seed: int, cache_dir: str | Path | None = None, separate_last_epoch: bool = False,
                       convention: str = "megatron_lm") -> tuple[GPTDataset | None, GPTDataset | None, GPTDataset | None]:
    """Train/valid/test :class:`GPTDataset` over ``prefix.{bin,idx}``, split by ``convention``
    (:func:`split_documents`).

    A split is ``None`` when it asks for 0 samples or has no documents / no tokens (logged as a warning);
    asking for samples from a corpus with no tokens at all is an error.
    """
    if len(num_samples) != 3 or any(int(s) < 0 for s in num_samples):
        raise GPTDatasetError(f"num_samples must be three non-negative counts (train, valid, test), got {num_samples}")
    parse_split(split)  # fail on a bad string before opening anything
    indexed = MMapIndexedDataset(prefix)
    if indexed.num_tokens == 0 and any(num_samples):
        raise GPTDatasetError(f"indexed dataset {prefix} has no tokens")
    docs = split_documents(indexed, split, convention)
    out: list[GPTDataset | None] = []
    for name, items, ns in zip(("train", "valid", "test"), docs, num_samples):
        if ns == 0:
            out.append(None)
            continue
        if len(items) == 0 or int(indexed.sizes[items].sum(dtype=np.int64)) == 0:
            logger.warning("%s split of %s (split %s) is empty: no %s dataset", name, prefix, split, name)
            out.append(None)
            continue
        out.append(GPTDataset(name, indexed, items, int(ns), seq_length, seed,
                              Path(cache_dir) if cache_dir is not None else None, separate_last_epoch))
    return out[0], out[1], out[2]
