"""What the Hugging Face import and export share: the check for the ``hf`` extra and GPT-2's name map.

:mod:`training.tools.import_hf` and :mod:`training.tools.export_hf` both build on this module (BERT's
name map is :mod:`training.tools.hf_bert`); it imports neither.
"""
from __future__ import annotations

import math

from megatron_ds_suite.core.errors import SuiteError

HF_EXTRA = "pip install 'megatron-ds-suite[hf]' (or pip install transformers)"


class ImportHFError(SuiteError):
    """Bad import input (one line: what is wrong and how to fix it)."""


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise ImportHFError(f"Hugging Face interop needs the `hf` extra: {HF_EXTRA}") from None
    return transformers


def gpt2_layer_names(num_layers: int) -> list[tuple[str, str, bool]]:
    """(our name, transformers' GPT-2 name, transposed?) for every tensor after the embeddings: the one
    mapping :mod:`training.tools.export_hf` and :mod:`training.tools.import_hf` both use (HF ``Conv1D`` stores ``[in, out]``)."""
    names = []
    for i in range(num_layers):
        a, h = f"layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            names += [(a + ours + p, h + theirs + p, False) for p in (".weight", ".bias")]
        for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                             ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            names += [(a + ours + ".weight", h + theirs + ".weight", True), (a + ours + ".bias", h + theirs + ".bias", False)]
    names += [("final_ln" + p, "transformer.ln_f" + p, False) for p in (".weight", ".bias")]
    return names


def _shown(value) -> str:
    """A config value for a message: scalars as written, containers by type (no recursion into them)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)[:60]
    return f"a {type(value).__name__}"


def check_config(hf_cfg, counts: tuple[str, ...] = (), optional_counts: tuple[str, ...] = (),
                 probabilities: tuple[str, ...] = (), positives: tuple[str, ...] = ()) -> None:
    """The ``config.json`` values an import reads, checked before any is used: ``counts`` integers >= 1
    (``optional_counts`` may also be null), ``probabilities`` numbers in [0, 1), ``positives`` finite numbers > 0
    (absent keys keep transformers' defaults). The first bad one is one ImportHFError line naming the key."""
    def bad(key: str, want: str) -> ImportHFError:
        return ImportHFError(f"config.json: {key}={_shown(getattr(hf_cfg, key, None))} is not {want}: fix config.json "
                             f"(or save the model again)")

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for key in counts + optional_counts:
        v = getattr(hf_cfg, key, None)
        if v is None and key in optional_counts:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise bad(key, "an integer >= 1")
    for key in probabilities:
        v = getattr(hf_cfg, key, 0.0)
        if not number(v) or not 0.0 <= v < 1.0:
            raise bad(key, "a number in [0, 1)")
    for key in positives:
        v = getattr(hf_cfg, key, 1.0)
        if not number(v) or v <= 0:
            raise bad(key, "a finite number > 0")
