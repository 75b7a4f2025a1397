"""Weighted blending of several Megatron ``.bin/.idx`` datasets: ``data.prefixes: [[weight, PREFIX], ...]``,
in Megatron-LM's own sample order.

The sample sequence is Megatron-LM's ``BlendableDataset`` (``megatron/data/blendable_dataset.py``), as in
the 2021 reference tree ``90e0a0dd08`` (blending arrived in ``d3bb1a0603``, 2020-11-28; the greedy rule
below is unchanged up to HEAD ``d98e8a64dd``, ``megatron/core/datasets/helpers.cpp``), so a run can be
compared sample for sample with a Megatron run on the same ``--data-path``, split, sample counts,
sequence length and seed:

1. Weights (``get_datasets_weights_and_num_samples``, ``megatron/data/dataset_utils.py``): divided by
   their sum (a plain left-to-right float sum), then each prefix is asked for
   ``int(ceil(N * w_i * 1.005))`` samples of each split (Megatron's 0.5% margin). Megatron-Core's builder
   normalises in float64, asks ``ceil(ceil(N * w_i) * 1.005)``, splits by rounded cumulative boundaries and
   blends ``sum(ceil(N * w_i))`` positions: ``data.split_convention: megatron_core``
   (:mod:`training.data.split_convention`; ``tests/unit/test_megatron_core_split.py``).
2. Each prefix gets its own GPT dataset (:mod:`training.data.gpt_dataset`): its own train/valid/test
   split of its documents and its own ``doc_idx``/``sample_idx``/``shuffle_idx`` from
   ``RandomState(seed)``. Megatron's blending came with the 2021 GPT dataset, which shuffles a short last
   epoch apart (``separate_last_epoch``, 2020-12-11), so the prefixes use it unless
   ``data.separate_last_epoch: false`` is set (``tests/unit/test_megatron_fidelity.py`` checks those maps
   against Megatron 2021's ``_build_index_mappings``).
3. Blend (``helpers.cpp::build_blending_indices``): the weights are normalised once more in float64
   (``w / numpy.sum(w)``); then for each position ``p = 0, 1, ...`` the dataset with the largest error
   ``w_i * max(p, 1) - taken_i`` (float64, ``taken_i`` = samples already drawn from dataset i; ties to the
   lowest index) is drawn, its ``taken_i``-th sample. Note ``max(p, 1)``, not ``p + 1``: positions 0 and 1
   both use 1 (so a tiny weight still gets position 1). No dataset is ever more than one sample ahead of
   ``w_i * n``, but one can lag by more than a sample when there are several (1.24 samples for the five
   weights 1e-4/3/3/1e-3/2; the bound is K - 1; the 2- and 3-dataset sets tested stay within one), unlike
   this project's earlier (non-Megatron) interleaving.
   :func:`blending_indices` evaluates the same float64 expressions in the same order (one loop over the
   positions, ~1 us each; Python floats are IEEE doubles), so the choice is bit-identical, ties included.

``blended[i] = datasets[dataset_index[i]][dataset_sample_index[i]]``. The sequence is a pure function of
the weights, N and the per-prefix maps, identical for any DP/TP layout, and a resumed run
(``consumed_samples``) continues it exactly. Where a split is empty for some prefix (Megatron would fail
an assertion) the others are blended with their weights renormalised. Megatron sizes a blend as the sum
of its datasets' lengths; the first N positions are the same either way (the choice at a position never
depends on later ones), so only N are built. The prefixes may be written by this project's pipeline or
by Megatron's ``tools/preprocess_data.py``. Verified against Megatron's own code (its ``helpers.cpp`` blend
compiled, and its 2021 Python datasets run on our prefixes): ``tests/unit/test_blending_megatron.py``,
``tests/unit/test_blending.py``. Their token ids must be those of ``data.tokenizer`` (checked:
no id of a prefix reaches its vocabulary size, :mod:`training.data.token_range`).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from megatron_ds_suite.core.errors import ConfigError
from training.data.split_convention import check_convention, core_blend_size, core_normalise, core_samples_per_dataset
from training.data.token_range import check_token_ids

MARGIN = 1.005  # Megatron's get_datasets_weights_and_num_samples over-asks each dataset by 0.5%


def normalise(weights: list[float]) -> list[float]:
    """Megatron's ``get_datasets_weights_and_num_samples`` normalisation: a left-to-right float sum
    (not ``sum()``, which compensates rounding from Python 3.12 on)."""
    total = 0.0
    for w in weights:
        total += w
    return [w / total for w in weights]


def parse_prefixes(prefixes: list, convention: str = "megatron_lm") -> tuple[list[float], list[Path]]:
    """``[[weight, prefix], ...]`` -> (weights normalised as ``convention`` does, prefixes); one-line ConfigError
    on bad input."""
    if not isinstance(prefixes, list) or not prefixes:
        raise ConfigError("data.prefixes must be a non-empty list of [weight, PREFIX] pairs")
    weights, paths = [], []
    for i, item in enumerate(prefixes):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], str)
                and isinstance(item[0], (int, float)) and not isinstance(item[0], bool)):
            raise ConfigError(f"data.prefixes[{i}] must be [weight, PREFIX] (a number and a path without .bin/.idx), "
                              f"got {item!r}")
        w, p = float(item[0]), Path(item[1])
        if not w > 0 or not math.isfinite(w):
            raise ConfigError(f"data.prefixes[{i}]: weight must be > 0, got {item[0]!r}")
        for ext in (".bin", ".idx"):
            if not Path(str(p) + ext).is_file():
                raise ConfigError(f"data.prefixes[{i}]: {p}{ext} does not exist (give the prefix without .bin/.idx)")
        weights.append(w)
        paths.append(p)
    return (core_normalise(weights) if check_convention(convention) == "megatron_core" else normalise(weights)), paths


def samples_per_dataset(weights: list[float], num_samples: int) -> list[int]:
    """Megatron's ``int(ceil(N * w * 1.005))`` per (normalised) weight."""
    return [int(math.ceil(num_samples * w * MARGIN)) for w in weights]


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's ``build_blending_indices``: (dataset_index int16, dataset_sample_index int64), each [size]."""
    w = np.array(weights, dtype=np.float64)
    w /= np.sum(w)  # BlendableDataset's own normalisation, float64 like Megatron's
    ws = [float(x) for x in w]
    k = len(ws)
    if not 0 < k < 2**15:
        raise ConfigError(f"blending needs 1 to {2**15 - 1} datasets, got {k}")
    taken = [0] * k
    which = np.empty(size, dtype=np.int16)
    within = np.empty(size, dtype=np.int64)
    rest = range(1, k)
    for p in range(size):
        x = float(p) if p > 1 else 1.0
        best, err = 0, ws[0] * x - taken[0]
        for d in rest:
            e = ws[d] * x - taken[d]
            if e > err:
                best, err = d, e
        which[p] = best
        within[p] = taken[best]
        taken[best] += 1
    return which, within


class BlendedDataset:
    """``num_samples`` samples drawn from ``datasets`` in Megatron's blended order (see module docstring)."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int):
        self.datasets, self.weights = datasets, weights
        self.dataset_index, self.dataset_sample_index = blending_indices(weights, num_samples)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, ds in enumerate(datasets):
            if counts[d] > len(ds):
                raise ConfigError(f"blended dataset {d} ({getattr(ds, 'name', '')} of "
                                  f"{getattr(getattr(ds, 'indexed', None), 'prefix', '?')}) has {len(ds)} samples, "
                                  f"{int(counts[d])} needed; give it more weight or data")

    @property
    def sample_index(self) -> np.ndarray:
        return self.dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]


def build_blended_datasets(weights: list[float], prefixes: list[Path], split: str, num_samples: tuple[int, int, int],
                           seq_length: int, seed: int, cache_dir: Path | None, vocab_size: int,
                           separate_last_epoch: bool = True, convention: str = "megatron_lm"):
    """Train/valid/test blends (None where no prefix has that split); ``weights`` already normalised (as
    ``convention`` does: :func:`parse_prefixes`). With ``megatron_core`` (:mod:`training.data.split_convention`)
    each prefix is split and asked for samples as Megatron-Core's builder does, and a blend every prefix takes part
    in has its ``sum(ceil(N * w))`` positions."""
    from training.data.gpt_dataset import build_gpt_datasets

    core = check_convention(convention) == "megatron_core"
    per = []
    for w, p in zip(weights, prefixes):
        check_token_ids(p, vocab_size, cache_dir, "data.prefixes")
        want = tuple((core_samples_per_dataset if core else samples_per_dataset)([w], n)[0] if n else 0
                     for n in num_samples)
        per.append(build_gpt_datasets(p, split, want, seq_length, seed, cache_dir=cache_dir,
                                      separate_last_epoch=separate_last_epoch, convention=convention))
    out = []
    for k, n in enumerate(num_samples):
        parts = [(w, ds[k]) for w, ds in zip(weights, per) if ds[k] is not None]
        if n == 0 or not parts:
            out.append(None)
            continue
        size = core_blend_size(weights, n) if core and len(parts) == len(weights) else n
        out.append(BlendedDataset([ds for _, ds in parts], [w for w, _ in parts], size))
    return out[0], out[1], out[2]
