"""What the Hugging Face import and export share: the check for the ``hf`` extra and GPT-2's name map.

:mod:`training.tools.import_hf` and :mod:`training.tools.export_hf` both build on this module (BERT's
name map is :mod:`training.tools.hf_bert`); it imports neither.
"""
from __future__ import annotations

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
