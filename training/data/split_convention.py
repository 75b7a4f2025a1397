"""``data.split_convention``: whose document split and per-prefix sample counts a run follows.

* ``megatron_lm`` (default): Megatron-LM 2021 (``90e0a0dd08``, ``megatron/data/dataset_utils.py``):
  each part gets ``round(w_k * D)`` documents and the rounding excess is taken off every boundary
  (:func:`training.data.gpt_dataset.split_boundaries`); weights normalised by a left-to-right float sum; each
  prefix of a blend asked for ``int(ceil(N * w * 1.005))`` samples; the blend has N positions.
* ``megatron_core``: Megatron-Core 0.16.1 (``BlendedMegatronDatasetBuilder``,
  ``blended_megatron_dataset_config.py``): the split weights normalised in float64 (``w / numpy.sum(w)``),
  their running Python-float sums are the book-ends, and each boundary is ``int(round(c_k * D))`` of its
  cumulative fraction ``c_k`` (:func:`core_split_boundaries`), D being the *items* of a GPT ``.bin/.idx``
  (``GPTDataset.numel_low_level_dataset``; = documents when each document is one item, as
  ``data_pipeline`` writes) and the documents of a BERT corpus; blend weights normalised the same float64
  way; each prefix asked for ``ceil(ceil(N * w) * (1 + 0.005))`` samples
  (``_get_size_per_split_per_dataset`` with ``mid_level_dataset_surplus``); the blend has
  ``sum(ceil(N * w))`` positions (its first N are the same blend order as ever). Megatron-Core always
  shuffles a short last epoch apart, so ``data.separate_last_epoch`` is on for every source (its rule is
  2021's: ``training.data.gpt_dataset.separate_last_epoch_samples``).

The index maps of one prefix are a pure function of its split documents, sample count, sequence length,
seed and the last-epoch rule, all in their cache names (``training.data.gpt_dataset``), so the two
conventions share a map only where it is the same map. Checked against Megatron-Core's own builder:
``tests/unit/test_megatron_core_split.py``.
"""
from __future__ import annotations

import math

import numpy as np

from megatron_ds_suite.core.errors import ConfigError

CONVENTIONS = ("megatron_lm", "megatron_core")
CORE_SURPLUS = 0.005  # Megatron-Core's mid_level_dataset_surplus default


def core_normalise(weights: list[float]) -> list[float]:
    """Megatron-Core's ``normalize``: float64 ``w / numpy.sum(w)`` (numpy's pairwise sum)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def core_split_boundaries(weights: list[float], size: int) -> list[int]:
    """``[0, a, b, c]`` cut points of Megatron-Core's split over ``size`` elements; ``weights`` are the three
    raw split numbers (a part of weight 0 is empty: Megatron-Core builds no dataset for it)."""
    ends = [0.0]
    for w in core_normalise(weights):
        ends.append(ends[-1] + w)
    return [int(round(e * float(size))) for e in ends]


def core_samples_per_dataset(weights: list[float], num_samples: int) -> list[int]:
    """Samples Megatron-Core's builder asks of each (normalised) weight's dataset:
    ``ceil(ceil(N * w) * (1 + surplus))``."""
    return [int(math.ceil(math.ceil(num_samples * w) * (1 + CORE_SURPLUS))) for w in weights]


def core_blend_size(weights: list[float], num_samples: int) -> int:
    """Positions of Megatron-Core's blend of ``num_samples``: ``sum(ceil(N * w))`` (its per-dataset target)."""
    return sum(int(math.ceil(num_samples * w)) for w in weights)


def check_convention(convention: str) -> str:
    """``convention`` or a one-line ConfigError naming the two."""
    if convention not in CONVENTIONS:
        raise ConfigError(f"data.split_convention={convention!r} is not one of {' | '.join(CONVENTIONS)} "
                          f"(megatron_lm: Megatron-LM 2021's split and sample counts, the default; megatron_core: "
                          f"Megatron-Core's)")
    return convention


def refuse_other_convention(saved_config: dict | None, convention: str, where: str) -> None:
    """A resumed run keeps the split convention its checkpoint was trained with (a checkpoint from before the
    option has ``megatron_lm``): otherwise its data position would index other samples."""
    saved = ((saved_config or {}).get("data") or {}).get("split_convention", "megatron_lm")
    if saved != convention:
        raise ConfigError(f"checkpoint {where} was trained with data.split_convention={saved} but this run sets "
                          f"{convention}: resume with data.split_convention={saved} or start a new run.dir")
