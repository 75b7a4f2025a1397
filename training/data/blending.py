"""Weighted blending of several Megatron ``.bin/.idx`` datasets: ``data.prefixes: [[weight, PREFIX], ...]``.

As Megatron's ``--data-path 0.3 A 0.7 B``: each prefix becomes its own GPT dataset (train/valid/test
split of its documents, its own index maps), asked for ``ceil(w_i * N * 1.005)`` samples (Megatron's
0.5% margin) with weights normalised to sum 1, and a blended dataset of N samples interleaves them.
The interleaving is a pure function of the weights and N, without randomness: dataset i's k-th
sample is placed at "time" (k + 1/2) / w_i and all samples are taken in time order (ties by dataset
order). So every prefix of the sequence holds each dataset within one sample of w_i * n (Megatron's
greedy ``build_blending_indices`` has the same property), the sequence is identical for any DP/TP
layout, and a resumed run (``consumed_samples``) continues it exactly. The prefixes may be written by
this project's pipeline or by Megatron's ``tools/preprocess_data.py``; the token ids must be those of
``data.tokenizer`` (checked: no id of a prefix reaches its vocabulary size, :mod:`training.data.token_range`).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from training.config import ConfigError
from training.data.token_range import check_token_ids

MARGIN = 1.005  # Megatron's get_datasets_weights_and_num_samples over-asks each dataset by 0.5%


def parse_prefixes(prefixes: list) -> tuple[list[float], list[Path]]:
    """``[[weight, prefix], ...]`` -> (normalised weights, prefixes); one-line ConfigError on bad input."""
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
    total = sum(weights)
    return [w / total for w in weights], paths


def blend_order(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, sample_index_within_dataset), each [num_samples]: the deterministic interleaving."""
    times, which, within = [], [], []
    for d, w in enumerate(weights):
        n = int(math.ceil(w * num_samples)) + 1
        k = np.arange(n, dtype=np.int64)
        times.append((k + 0.5) / w)
        which.append(np.full(n, d, dtype=np.int64))
        within.append(k)
    t, d, k = np.concatenate(times), np.concatenate(which), np.concatenate(within)
    order = np.lexsort((d, t))[:num_samples]  # by time, ties by dataset order
    return d[order], k[order]


class BlendedDataset:
    """``num_samples`` samples drawn from ``datasets`` in the proportions ``weights`` (see module docstring)."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int):
        self.datasets, self.weights = datasets, weights
        self.dataset_index, self.sample_index = blend_order(weights, num_samples)
        for d, ds in enumerate(datasets):
            need = int((self.dataset_index == d).sum())
            if need and len(ds) < int(self.sample_index[self.dataset_index == d].max()) + 1:
                raise ValueError(f"blended dataset {d} has {len(ds)} samples, {need} needed")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[idx])][int(self.sample_index[idx])]


def build_blended_datasets(weights: list[float], prefixes: list[Path], split: str, num_samples: tuple[int, int, int],
                           seq_length: int, seed: int, cache_dir: Path | None, vocab_size: int):
    """Train/valid/test blends (None where no prefix has that split)."""
    from training.data.gpt_dataset import build_gpt_datasets

    per = []
    for w, p in zip(weights, prefixes):
        check_token_ids(p, vocab_size, cache_dir, "data.prefixes")
        want = tuple(int(math.ceil(w * n * MARGIN)) + 1 if n else 0 for n in num_samples)
        per.append(build_gpt_datasets(p, split, want, seq_length, seed, cache_dir=cache_dir))
    out = []
    for k, n in enumerate(num_samples):
        parts = [(w, ds[k]) for w, ds in zip(weights, per) if ds[k] is not None]
        if n == 0 or not parts:
            out.append(None)
            continue
        total = sum(w for w, _ in parts)
        out.append(BlendedDataset([ds for _, ds in parts], [w / total for w, _ in parts], n))
    return out[0], out[1], out[2]

