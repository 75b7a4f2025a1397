"""Tensors against the model that will hold them: the one check both importers make before writing anything.

:mod:`training.tools.hf_weights` compares a transformers folder's tensors with the model its ``config.json`` builds
(transformers' names); :func:`training.tools.import_hf.write_checkpoint` compares every import (Hugging Face and
Megatron-LM) with our own model of the config it writes (:func:`model_shapes`). A tensor the model lacks, one the
files lack, one of another shape and one holding NaN or Inf are refused in one line that names the first few of each
kind and counts them -- never filled with random values, dropped or passed on.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

import torch

from megatron_ds_suite.core.errors import SuiteError

SHOWN = 3  # names listed per kind of problem; the rest are counted


class WeightsError(SuiteError):
    """Weights that do not fit the model they are imported into, or hold NaN/Inf (one line naming them)."""


def few(items: Iterable[str], limit: int = SHOWN) -> str:
    """``'a, b, c and 5 more'``: the first ``limit`` items (in order) and a count of the rest."""
    items = list(items)
    head = ", ".join(items[:limit])
    return head + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def shape_problems(found: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]],
                   optional: Collection[str] = ()) -> list[str]:
    """What keeps ``found`` ({name: shape}) from being ``expected`` ({name: shape}), as phrases ('2 missing (a, b)',
    '1 unexpected (c)', '1 of another shape (d [3, 4], the model's [3, 5])'); empty when they fit. ``optional``:
    names the model has that may be absent (tied copies), but must have the model's shape when present."""
    missing = [n for n in expected if n not in found and n not in optional]
    unexpected = [n for n in found if n not in expected]
    other = [n for n in found if n in expected and tuple(found[n]) != tuple(expected[n])]
    out = []
    if missing:
        out.append(f"{len(missing)} missing ({few(missing)})")
    if unexpected:
        out.append(f"{len(unexpected)} unexpected ({few(unexpected)})")
    if other:
        out.append(f"{len(other)} of another shape ("
                   + few(f"{n} {_shape(found[n])}, the model's {_shape(expected[n])}" for n in other) + ")")
    return out


def check_shapes(found: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]], source: str, fix: str,
                 optional: Collection[str] = (), hint: str = "") -> None:
    """:func:`shape_problems` as one WeightsError line: ``source``, the problems, ``hint`` (a likely cause), ``fix``."""
    problems = shape_problems(found, expected, optional)
    if problems:
        raise WeightsError(f"{source}: the tensors do not fit the model: {'; '.join(problems)}{hint}: {fix}")


def non_finite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding NaN or +-Inf, in order."""
    return [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def not_floating(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the tensors of an integer or boolean dtype (a weight is floating-point)."""
    return [f"{n} ({str(t.dtype).removeprefix('torch.')})" for n, t in tensors.items() if not t.is_floating_point()]


def check_values(tensors: Mapping[str, torch.Tensor], source: str) -> None:
    """Every tensor floating-point and finite; else one WeightsError line naming the first few."""
    ints = not_floating(tensors)
    if ints:
        raise WeightsError(f"{source}: {len(ints)} weight tensor(s) are not floating-point ({few(ints)}): not a "
                           f"model's weights; save the model again")
    bad = non_finite(tensors)
    if bad:
        raise WeightsError(f"{source}: {len(bad)} weight tensor(s) hold NaN or Inf values ({few(bad)}): a diverged "
                           f"or damaged model; import a checkpoint from before it diverged, or save the model again")


def model_shapes(model_cfg, vocab_rows: int) -> dict[str, tuple[int, ...]]:
    """{parameter name: shape} of our model for ``model_cfg`` at TP=1 with ``vocab_rows`` vocabulary rows, built on
    the meta device (no memory, no initialisation cost)."""
    from training.models.bert import BertModel
    from training.models.gpt2 import GPTModel

    with torch.device("meta"):
        model = (BertModel if model_cfg.arch == "bert" else GPTModel)(model_cfg, vocab_rows, None, seed=0)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}
