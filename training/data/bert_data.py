"""BERT pretraining samples from a sentence-level indexed dataset (Megatron ``bert_dataset.py``).

Input: an MMIDIDX dataset with one item per *sentence*; ``doc_idx`` delimits documents.

1. Samples mapping (:func:`build_samples_mapping`, Megatron's C++ ``build_mapping``): per epoch, per
   document with >= 2 sentences, sentences are accumulated greedily until the running length reaches a
   target; every sample holds >= 2 sentences, and a sample is closed early only when >= 2 sentences
   remain for the next one. The target is ``max_seq_length - 3`` (room for [CLS] and two [SEP]), or
   with probability ``short_seq_prob`` a random length in [2, max_seq_length - 3]. Rows
   ``(first_sentence, end_sentence, target_len)``, epochs appended until ``num_samples`` rows exist,
   then shuffled. Documents with fewer than two sentences are skipped and *counted*
   (:class:`MappingStats`), never a crash; a split with no usable document is a clear error.
2. Sample ``idx`` (:func:`build_sample`), drawn from ``RandomState(seed + idx)`` so every sample is
   deterministic and independent of the order it is read in:
   - A = the first ``a_end`` sentences (``a_end`` uniform in [1, n-1]), B = the rest, of one document;
     swapped with probability 0.5 for sentence-order prediction (``is_random`` = 1 when swapped);
   - the longer segment loses a token from its front or back (coin flip) until A + B fits the target;
   - ``[CLS] A [SEP] B [SEP]``, token types 0 for [CLS] A [SEP], 1 for B [SEP];
   - masking (:func:`mask_tokens`), then padding to ``max_seq_length``.
3. Masking, Megatron's budget: ``num_to_predict = min(max_predictions, max(1, round(masked_lm_prob *
   len(tokens))))`` with the float cap ``max_predictions = masked_lm_prob * target_len`` (Megatron's
   ``max_predictions_per_seq = masked_lm_prob * max_num_tokens``; the target excludes [CLS]/[SEP]): at
   max_seq_length 128 the cap is 0.15 x 125 = 18.75, so at most 18 tokens (14.1 %), not round(19.2) = 19;
   candidate units are whole
   words (a word-start piece and the pieces that continue it; never [CLS]/[SEP]); a span is an n-gram
   of 1..max_ngram consecutive words of one segment, n drawn with p(n) proportional to 1/n (shortened
   when it would overshoot the budget, skipped if it still does or overlaps a chosen span). Every
   token of a chosen span: 80 % [MASK], 10 % a random ordinary vocabulary id, 10 % unchanged.

Sample keys (numpy, length ``max_seq_length``): ``text``, ``types``, ``labels`` (-1 except at masked
positions), ``loss_mask``, ``padding_mask``, plus scalars ``is_random`` and ``truncated``.
"""
from __future__ import annotations

import hashlib
import logging
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.errors import SuiteError

logger = logging.getLogger(__name__)


class BertDataError(SuiteError):
    """The data cannot make BERT samples (one clear line saying why and how to fix it)."""


@dataclass(frozen=True)
class BertVocab:
    """What masking needs from a BERT-flavour tokenizer."""

    cls: int
    sep: int
    mask: int
    pad: int
    word_start: np.ndarray      # bool [vocab]: piece i starts a word
    random_ids: np.ndarray      # ids a random replacement may take (no special/control ids)

    @classmethod
    def from_tokenizer(cls, tok) -> BertVocab:
        ids = {k: getattr(tok, k, None) for k in ("cls", "sep", "mask", "pad")}
        missing = [f"[{k.upper()}]" for k, v in ids.items() if v is None]
        if missing or not hasattr(tok, "word_start_mask"):
            raise BertDataError(f"the vocabulary of {tok!r} lacks {', '.join(missing) or 'word-start information'}: "
                                "BERT needs a BERT-flavour vocabulary; build the corpus with tokenizer.flavor=bert "
                                "dataset.bert=true (python -m data_pipeline build)")
        word_start = np.asarray(tok.word_start_mask(), dtype=bool)
        special = {ids["cls"], ids["sep"], ids["mask"], ids["pad"], getattr(tok, "unk", None)}
        ordinary = np.array([i for i in range(tok.vocab_size) if i not in special], dtype=np.int64)
        return cls(ids["cls"], ids["sep"], ids["mask"], ids["pad"], word_start, ordinary)


@dataclass(frozen=True)
class MaskingConfig:
    masked_lm_prob: float = 0.15
    mask_token_prob: float = 0.8
    random_token_prob: float = 0.1
    max_ngram: int = 3
    whole_word: bool = True


# --------------------------------------------------------------------------------------------------
# Samples mapping
# --------------------------------------------------------------------------------------------------
@dataclass
class MappingStats:
    documents: int = 0
    skipped_short_documents: int = 0
    """Documents with fewer than two sentences (no A/B pair possible): skipped, counted."""
    samples_per_epoch: int = 0
    epochs: int = 0
    samples: int = 0
    problems: list[str] = field(default_factory=list)


def usable_documents(doc_idx: np.ndarray, documents: np.ndarray) -> tuple[np.ndarray, int]:
    """(documents with >= 2 sentences, number skipped)."""
    n_sent = doc_idx[documents + 1] - doc_idx[documents]
    keep = documents[n_sent >= 2]
    return keep, int(len(documents) - len(keep))


def _epoch_mapping(doc_idx: np.ndarray, sizes: np.ndarray, documents: np.ndarray, max_num_tokens: int,
                   short_seq_prob: float, rng: np.random.RandomState) -> list[tuple[int, int, int]]:
    def target() -> int:
        if short_seq_prob > 0 and rng.random_sample() < short_seq_prob:
            return int(rng.randint(2, max_num_tokens + 1))
        return max_num_tokens

    rows: list[tuple[int, int, int]] = []
    tgt = target()
    for d in documents:
        first, end = int(doc_idx[d]), int(doc_idx[d + 1])
        start, seq_len, n_sent = first, 0, 0
        for i in range(first, end):
            seq_len += int(sizes[i])
            n_sent += 1
            remain = end - i - 1
            if (seq_len >= tgt and remain > 1 and n_sent >= 2) or remain == 0:
                rows.append((start, i + 1, tgt))
                start, seq_len, n_sent = i + 1, 0, 0
                tgt = target()
    return rows


def build_samples_mapping(doc_idx: np.ndarray, sizes: np.ndarray, documents: np.ndarray, num_samples: int,
                          max_seq_length: int, short_seq_prob: float, seed: int) -> tuple[np.ndarray, MappingStats]:
    """int64 [N >= num_samples, 3] rows ``(start_sentence, end_sentence, target_len)``, shuffled."""
    stats = MappingStats(documents=int(len(documents)))
    docs, skipped = usable_documents(doc_idx, np.asarray(documents, dtype=np.int64))
    stats.skipped_short_documents = skipped
    if len(docs) == 0:
        raise BertDataError(
            f"none of the {len(documents)} documents has two or more sentences, so no A/B sentence pair exists: "
            "this is not a sentence-split dataset (build the corpus with dataset.bert=true, one item per sentence)")
    if max_seq_length < 5:
        raise BertDataError(f"max_seq_length {max_seq_length} leaves no room for [CLS] A [SEP] B [SEP]")
    rng = np.random.RandomState(seed % 2**32)
    rows: list[tuple[int, int, int]] = []
    while len(rows) < max(num_samples, 1):
        epoch = _epoch_mapping(doc_idx, sizes, docs, max_seq_length - 3, short_seq_prob, rng)
        if stats.epochs == 0:
            stats.samples_per_epoch = len(epoch)
        rows.extend(epoch)
        stats.epochs += 1
    mapping = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    np.random.RandomState((seed + 1) % 2**32).shuffle(mapping)
    stats.samples = len(mapping)
    return mapping, stats


# --------------------------------------------------------------------------------------------------
# One sample
# --------------------------------------------------------------------------------------------------
def split_segments(sentences: list[np.ndarray], rng: np.random.RandomState) -> tuple[list[int], list[int], int]:
    """A/B from consecutive sentences of one document; swapped with p = 0.5 (-> is_random = 1)."""
    n = len(sentences)
    if n < 2:
        raise BertDataError(f"a BERT sample needs >= 2 sentences, got {n}")
    a_end = 1 if n == 2 else int(rng.randint(1, n))
    a = [int(t) for s in sentences[:a_end] for t in s]
    b = [int(t) for s in sentences[a_end:] for t in s]
    is_random = 0
    if rng.random_sample() < 0.5:
        a, b, is_random = b, a, 1
    return a, b, is_random


def truncate_segments(a: list[int], b: list[int], max_num_tokens: int, rng: np.random.RandomState) -> bool:
    """Drop tokens from the front or back (coin flip) of the longer segment until len(a)+len(b) fits."""
    if len(a) + len(b) <= max_num_tokens:
        return False
    while len(a) + len(b) > max_num_tokens:
        seg = a if len(a) > len(b) else b
        if rng.random_sample() < 0.5:
            del seg[0]
        else:
            seg.pop()
    return True


def word_units(tokens: np.ndarray, segments: np.ndarray, special: np.ndarray, word_start: np.ndarray,
               whole_word: bool) -> list[list[int]]:
    """Positions grouped into words (whole-word units); special positions excluded. A continuation piece
    right after a special token (or at a segment change) starts a unit of its own."""
    units: list[list[int]] = []
    prev_ok = False
    for i in range(len(tokens)):
        if special[i]:
            prev_ok = False
            continue
        if whole_word and prev_ok and not word_start[tokens[i]] and segments[i] == segments[i - 1]:
            units[-1].append(i)
        else:
            units.append([i])
        prev_ok = True
    return units


def mask_tokens(tokens: np.ndarray, segments: np.ndarray, vocab: BertVocab, cfg: MaskingConfig,  # noqa: C901
                rng: np.random.RandomState, draws: list[int] | None = None,
                max_predictions: float | None = None) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Whole-word n-gram masking. Returns (masked tokens, labels (-1 = not predicted), lengths in words of the
    spans masked). ``max_predictions`` is Megatron's float cap on the budget (None = no cap). ``draws``
    (optional) collects the drawn n of every candidate with all n available (for tests: the drawn
    distribution is exactly p(n) ∝ 1/n; the masked spans lean shorter, as budget and overlaps cut long
    spans more often)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    out = tokens.copy()
    labels = np.full(len(tokens), -1, dtype=np.int64)
    special = (tokens == vocab.cls) | (tokens == vocab.sep) | (tokens == vocab.pad)
    units = word_units(tokens, segments, special, vocab.word_start, cfg.whole_word)
    if cfg.masked_lm_prob <= 0 or not units:
        return out, labels, []
    num_to_predict: float = max(1, int(round(len(tokens) * cfg.masked_lm_prob)))
    if max_predictions is not None:  # a float, as in Megatron: 18.75 allows 18 predictions
        num_to_predict = min(num_to_predict, max_predictions)
    ngrams = np.arange(1, cfg.max_ngram + 1)
    pvals = 1.0 / ngrams
    # candidate n-grams: up to max_ngram consecutive words starting at each word, within one segment
    starts = np.arange(len(units))
    rng.shuffle(starts)
    covered = np.zeros(len(tokens), dtype=bool)
    n_masked = 0
    spans: list[int] = []
    for w in starts:
        if n_masked >= num_to_predict:
            break
        seg = segments[units[w][0]]
        avail = 1
        while (avail < cfg.max_ngram and w + avail < len(units) and segments[units[w + avail][0]] == seg):
            avail += 1
        p = pvals[:avail] / pvals[:avail].sum()
        n = int(rng.choice(ngrams[:avail], p=p))
        if draws is not None and avail == cfg.max_ngram:
            draws.append(n)
        positions = [i for u in units[w:w + n] for i in u]
        while n_masked + len(positions) > num_to_predict and n > 1:  # try shorter n-grams
            n -= 1
            positions = [i for u in units[w:w + n] for i in u]
        if n_masked + len(positions) > num_to_predict or covered[positions].any():
            continue
        for i in positions:
            covered[i] = True
            labels[i] = tokens[i]
            r = rng.random_sample()
            if r < cfg.mask_token_prob:
                out[i] = vocab.mask
            elif r < cfg.mask_token_prob + cfg.random_token_prob:
                out[i] = vocab.random_ids[rng.randint(0, len(vocab.random_ids))]
            # else: unchanged
        n_masked += len(positions)
        spans.append(n)
    return out, labels, spans


def build_sample(sentences: list[np.ndarray], target_len: int, max_seq_length: int, vocab: BertVocab,
                 cfg: MaskingConfig, rng: np.random.RandomState) -> dict:
    """One padded sample (keys in the module docstring; ``spans``, ``draws`` and ``original`` = the unmasked
    ``[CLS] A [SEP] B [SEP]`` are for inspection)."""
    a, b, is_random = split_segments(sentences, rng)
    max_num_tokens = min(target_len, max_seq_length - 3)
    truncated = truncate_segments(a, b, max_num_tokens, rng)
    tokens = np.asarray([vocab.cls, *a, vocab.sep, *b, vocab.sep], dtype=np.int64)
    types = np.asarray([0] * (len(a) + 2) + [1] * (len(b) + 1), dtype=np.int64)
    draws: list[int] = []
    masked, labels, spans = mask_tokens(tokens, types, vocab, cfg, rng, draws,
                                        max_predictions=cfg.masked_lm_prob * max_num_tokens)
    pad = max_seq_length - len(tokens)
    n = len(tokens)
    return {
        "text": np.concatenate([masked, np.full(pad, vocab.pad, dtype=np.int64)]),
        "types": np.concatenate([types, np.zeros(pad, dtype=np.int64)]),
        "labels": np.concatenate([labels, np.full(pad, -1, dtype=np.int64)]),
        "loss_mask": np.concatenate([(labels >= 0).astype(np.int64), np.zeros(pad, dtype=np.int64)]),
        "padding_mask": np.concatenate([np.ones(n, dtype=np.int64), np.zeros(pad, dtype=np.int64)]),
        "is_random": np.int64(is_random),
        "truncated": np.int64(truncated),
        "spans": spans,
        "draws": draws,
        "original": tokens,
    }


# --------------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------------
class BertDataset:
    """Megatron's BertDataset over one split's documents. ``ds[i]`` is deterministic in (seed, i)."""

    def __init__(self, indexed, documents: np.ndarray, num_samples: int, max_seq_length: int, vocab: BertVocab,
                 masking: MaskingConfig, short_seq_prob: float, seed: int, name: str = "train",
                 cache_dir: str | Path | None = None):
        self.indexed, self.max_seq_length, self.vocab, self.masking, self.seed = (
            indexed, max_seq_length, vocab, masking, seed)
        self.name = name
        self.mapping, self.stats = self._mapping(documents, num_samples, short_seq_prob, cache_dir)

    def _mapping(self, documents, num_samples, ssp, cache_dir):
        docs = np.asarray(documents, dtype=np.int64)
        if cache_dir is None:
            return build_samples_mapping(self.indexed.doc_idx, self.indexed.sizes, docs, num_samples,
                                         self.max_seq_length, ssp, self.seed)
        digest = hashlib.sha256(np.ascontiguousarray(docs).tobytes()
                                + f"{len(self.indexed)}:{self.indexed.num_tokens}".encode()).hexdigest()[:10]
        prefix = Path(self.indexed.prefix).name
        path = Path(cache_dir) / (f"{prefix}_{self.name}_indexmap_{num_samples}mns_{self.max_seq_length}msl_"
                                  f"{ssp:.2f}ssp_{self.seed}s_{digest}.npz")
        if path.is_file():
            cached, problem = self._load_mapping(path)
            if cached is not None:
                return cached
            logger.warning("cached BERT %s samples mapping %s is damaged (%s): rebuilding it", self.name, path, problem)
        mapping, st = build_samples_mapping(self.indexed.doc_idx, self.indexed.sizes, docs, num_samples,
                                            self.max_seq_length, ssp, self.seed)
        with atomic.atomic_path(path) as tmp:  # keeps the .npz suffix np.savez would otherwise add
            np.savez(tmp, mapping=mapping, documents=st.documents, skipped_short_documents=st.skipped_short_documents,
                     samples_per_epoch=st.samples_per_epoch, epochs=st.epochs, samples=st.samples)
        logger.info("BERT %s samples mapping: %d samples (%d per epoch, %d epochs) from %d documents, %d skipped "
                    "(< 2 sentences) -> %s", self.name, st.samples, st.samples_per_epoch, st.epochs, st.documents,
                    st.skipped_short_documents, path)
        return mapping, st

    def _load_mapping(self, path: Path):
        """((mapping, stats), None), or (None, what is wrong) for an unreadable or damaged (e.g. zeroed) file:
        every row must be sentences ``start < end`` of this dataset and a target length of at least 1."""
        try:
            with np.load(path, allow_pickle=False) as z:
                st = MappingStats(**{k: int(z[k]) for k in ("documents", "skipped_short_documents",
                                                              "samples_per_epoch", "epochs", "samples")})
                mapping = np.asarray(z["mapping"])
        except (ValueError, OSError, KeyError, EOFError, zipfile.BadZipFile) as e:
            return None, f"unreadable: {str(e)[:80]}"
        if mapping.ndim != 2 or mapping.shape != (st.samples, 3):
            return None, f"mapping of shape {mapping.shape} for {st.samples} samples"
        if len(mapping) and not (int(mapping[:, 0].min()) >= 0 and bool((mapping[:, 0] < mapping[:, 1]).all())
                                 and int(mapping[:, 1].max()) <= len(self.indexed) and int(mapping[:, 2].min()) >= 1):
            return None, "rows that are not sentence ranges of this dataset"
        return (mapping, st), None

    def __len__(self) -> int:
        return len(self.mapping)

    def __getitem__(self, idx: int) -> dict:
        start, end, target = (int(x) for x in self.mapping[idx])
        rng = np.random.RandomState((self.seed + int(idx)) % 2**32)
        sentences = [np.asarray(self.indexed[i]) for i in range(start, end)]
        return build_sample(sentences, target, self.max_seq_length, self.vocab, self.masking, rng)


def collate(samples: list[dict]):
    """Stack samples into int64 torch tensors: text/types/labels/loss_mask/padding_mask [b, s], is_random [b]."""
    import torch

    keys = ("text", "types", "labels", "loss_mask", "padding_mask")
    out = {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in keys}
    out["is_random"] = torch.tensor([int(s["is_random"]) for s in samples], dtype=torch.long)
    return out
