"""Whether a model shape fits a parallel layout: the planner's checks before any arithmetic.

The layout itself is :class:`training.layout.Layout`, the trainer's too; its own rules (degrees, batch split)
are :meth:`~training.layout.Layout.check`. The rules that need the model (heads, query groups, MLP width and
padded vocabulary divisible by TP, layers by PP, positions covering the sequence) are
:func:`training.models.config.validate_shape`, the same the trainer's ``validate_static`` runs.
"""
from __future__ import annotations

from training.layout import Layout
from training.models.config import validate_shape
from training.plan.accounting import ModelShape


def validate(shape: ModelShape, lay: Layout) -> None:
    """One-line ConfigError for every impossible combination, before any arithmetic: the layout's own rules,
    then the shape rules the trainer checks too (:func:`training.models.config.validate_shape`)."""
    lay.check(flags=True)
    validate_shape(shape, lay.tp, lay.pp, lay.sequence_parallel, flags=True)
