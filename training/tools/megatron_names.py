"""Megatron-LM's tensor names -> ours, for both layouts its ``torch``-format checkpoints hold
(:func:`rename`), and how its tensor parallelism splits each of our tensors (:func:`split_dim`).

The legacy layout (``megatron/legacy/model``: ``language_model.embedding`` / ``.encoder``, called
``.transformer`` before 2021; attention ``self_attention`` or ``attention``; norms ``*_layernorm`` or ``*_norm``)
and the Megatron-Core layout (``embedding``, ``decoder`` / BERT's ``encoder``, ``output_layer``; with Transformer
Engine's fused norms the pre-attention and pre-MLP norms live inside the next linear as ``layer_norm_weight``):

    legacy                                       Megatron-Core                                   ours
    language_model.embedding.word_embeddings     embedding.word_embeddings                       embedding.word_embeddings
    ...position_embeddings / tokentype_embeddings  the same                                      the same
    layers.i.input_layernorm (input_norm)        layers.i.input_layernorm |
                                                 layers.i.self_attention.linear_qkv.layer_norm_*  layers.i.ln1
    layers.i.*attention.query_key_value          layers.i.self_attention.linear_qkv              layers.i.attn.qkv
    layers.i.*attention.dense                    layers.i.self_attention.linear_proj             layers.i.attn.proj
    layers.i.post_attention_layernorm            layers.i.pre_mlp_layernorm |
                                                 layers.i.mlp.linear_fc1.layer_norm_*             layers.i.ln2
    layers.i.mlp.dense_h_to_4h / dense_4h_to_h   layers.i.mlp.linear_fc1 / linear_fc2            layers.i.mlp.fc / mlp.proj
    final_layernorm (final_norm)                 decoder.final_layernorm                         final_ln
    language_model.output_layer (untied)         output_layer                                    output_layer
    BERT: lm_head.dense / lm_head.layernorm      lm_head.dense / lm_head.layer_norm              lm_head.dense / lm_head.ln
          lm_head.bias                           output_layer.bias                               lm_head.bias
          language_model.pooler.dense            pooler.dense                                    pooler
          binary_head                            binary_head                                     binary_head

Layer i of pipeline stage s is global layer (layers of stages < s) + i (both layouts number a stage's layers
from 0 in ``torch``-format files). The tied output copy of the last stage (legacy ``word_embeddings_for_head``,
Megatron-Core ``output_layer.weight`` when the output is tied) is not read: it equals the embedding.
"""
from __future__ import annotations

import re

from training.tools.megatron_reader import ImportMegatronError

_LAYERS = r"(?:language_model\.(?:encoder|transformer)|decoder|encoder)\.layers\.(\d+)\."
_LAYER = _LAYERS + r"(.+)\.(weight|bias)"
_TE_NORM = _LAYERS + r"(self_attention\.linear_qkv|mlp\.linear_fc1)\.layer_norm_(weight|bias)"

# a layer's own names -> ours (legacy, then Megatron-Core, then Transformer Engine's fused norms)
LAYER_NAMES = {
    r"input_(?:layer)?norm": "ln1",
    r"post_attention_(?:layer)?norm": "ln2",
    r"(?:self_)?attention\.query_key_value": "attn.qkv",
    r"(?:self_)?attention\.dense": "attn.proj",
    r"mlp\.dense_h_to_4h": "mlp.fc",
    r"mlp\.dense_4h_to_h": "mlp.proj",
    r"pre_mlp_layernorm": "ln2",
    r"self_attention\.linear_qkv": "attn.qkv",
    r"self_attention\.linear_proj": "attn.proj",
    r"mlp\.linear_fc1": "mlp.fc",
    r"mlp\.linear_fc2": "mlp.proj",
}
TE_NORMS = {"self_attention.linear_qkv": "ln1", "mlp.linear_fc1": "ln2"}

FIXED = {
    "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "language_model.embedding.tokentype_embeddings.weight": "embedding.tokentype_embeddings.weight",
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "embedding.tokentype_embeddings.weight": "embedding.tokentype_embeddings.weight",
    "language_model.pooler.dense.weight": "pooler.weight", "language_model.pooler.dense.bias": "pooler.bias",
    "pooler.dense.weight": "pooler.weight", "pooler.dense.bias": "pooler.bias",
    "lm_head.dense.weight": "lm_head.dense.weight", "lm_head.dense.bias": "lm_head.dense.bias",
    "lm_head.bias": "lm_head.bias", "output_layer.bias": "lm_head.bias",
    "binary_head.weight": "binary_head.weight", "binary_head.bias": "binary_head.bias",
    "language_model.output_layer.weight": "output_layer.weight",
}

# how TP splits each of our tensors in Megatron's files: dim of the split (absent: replicated)
SPLIT_DIM = {"attn.qkv": 0, "attn.proj.weight": 1, "mlp.fc": 0, "mlp.proj.weight": 1,
             "embedding.word_embeddings.weight": 0, "lm_head.bias": 0, "output_layer.weight": 0}


def layer_of(name: str) -> int | None:
    """The stage-local layer index of a Megatron tensor name (either layout), None outside the layers."""
    m = re.match(_LAYERS, name)
    return int(m.group(1)) if m else None


def layer_name(name: str, layer: int, body: str, kind: str) -> str:
    """Ours for tensor ``body.kind`` of global layer ``layer`` (``name``: Megatron's whole name, for the error)."""
    for pattern, ours in LAYER_NAMES.items():
        if re.fullmatch(pattern, body):
            return f"layers.{layer}.{ours}.{kind}"
    what = ("query/key normalisation (qk_layernorm)" if "q_layernorm" in body or "k_layernorm" in body
            else "mixture of experts" if ".experts." in body or ".router." in body else "a tensor")
    raise ImportMegatronError(f"unknown layer tensor {name!r} ({what}): neither Megatron-LM's legacy nor its "
                              f"Megatron-Core GPT/BERT layout computes it here")


def rename(name: str, layer_offset: int, untied: bool) -> str | None:
    """A flattened Megatron name (either layout) -> ours, the layer index shifted by the stage's offset; None = a
    tensor not imported (the tied output copy); one line for a name neither layout has."""
    m = re.fullmatch(_TE_NORM, name)
    if m:
        return f"layers.{int(m.group(1)) + layer_offset}.{TE_NORMS[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(_LAYER, name)
    if m:
        return layer_name(name, int(m.group(1)) + layer_offset, m.group(2), m.group(3))
    m = re.fullmatch(r"(?:language_model\.(?:encoder|transformer)|decoder|encoder)\.final_(?:layer)?norm\.(weight|bias)",
                     name)
    if m:
        return f"final_ln.{m.group(1)}"
    m = re.fullmatch(r"lm_head\.(?:layer)?(?:_)?norm\.(weight|bias)", name)
    if m:
        return f"lm_head.ln.{m.group(1)}"
    if name in FIXED:
        if FIXED[name] == "output_layer.weight" and not untied:
            raise ImportMegatronError(f"{name!r} in a checkpoint whose args tie the output to the embedding: a "
                                      f"damaged or edited checkpoint")
        return FIXED[name]
    if name == "output_layer.weight":  # Megatron-Core: the untied head, or the last stage's tied copy
        return "output_layer.weight" if untied else None
    if name.startswith("word_embeddings_for_head."):
        return None
    raise ImportMegatronError(f"unknown tensor {name!r}: neither Megatron-LM's legacy nor its Megatron-Core GPT/BERT "
                              f"layout")


def split_dim(name: str) -> int | None:
    """The dim along which Megatron's TP ranks hold parts of our tensor ``name`` (None: each holds all of it)."""
    body = re.sub(r"^layers\.\d+\.", "", name)
    for key, dim in SPLIT_DIM.items():
        if body == key or body.startswith(key + "."):
            return dim
    return None


# ours -> Megatron, per layout (the inverse of :func:`rename`); a layer's tensors get the layer prefix of the layout
LAYER_TO_MEGATRON = {
    "core": {"ln1": "input_layernorm", "attn.qkv": "self_attention.linear_qkv",
             "attn.proj": "self_attention.linear_proj", "ln2": "pre_mlp_layernorm", "mlp.fc": "mlp.linear_fc1",
             "mlp.proj": "mlp.linear_fc2"},
    "legacy": {"ln1": "input_layernorm", "attn.qkv": "self_attention.query_key_value",
               "attn.proj": "self_attention.dense", "ln2": "post_attention_layernorm", "mlp.fc": "mlp.dense_h_to_4h",
               "mlp.proj": "mlp.dense_4h_to_h"},
}
FIXED_TO_MEGATRON = {
    "core": {"embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
             "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
             "embedding.tokentype_embeddings.weight": "embedding.tokentype_embeddings.weight",
             "output_layer.weight": "output_layer.weight", "pooler.weight": "pooler.dense.weight",
             "pooler.bias": "pooler.dense.bias", "lm_head.dense.weight": "lm_head.dense.weight",
             "lm_head.dense.bias": "lm_head.dense.bias", "lm_head.ln.weight": "lm_head.layer_norm.weight",
             "lm_head.ln.bias": "lm_head.layer_norm.bias", "lm_head.bias": "output_layer.bias",
             "binary_head.weight": "binary_head.weight", "binary_head.bias": "binary_head.bias"},
    "legacy": {"embedding.word_embeddings.weight": "language_model.embedding.word_embeddings.weight",
               "embedding.position_embeddings.weight": "language_model.embedding.position_embeddings.weight",
               "embedding.tokentype_embeddings.weight": "language_model.embedding.tokentype_embeddings.weight",
               "output_layer.weight": "language_model.output_layer.weight",
               "pooler.weight": "language_model.pooler.dense.weight", "pooler.bias": "language_model.pooler.dense.bias",
               "lm_head.dense.weight": "lm_head.dense.weight", "lm_head.dense.bias": "lm_head.dense.bias",
               "lm_head.ln.weight": "lm_head.layernorm.weight", "lm_head.ln.bias": "lm_head.layernorm.bias",
               "lm_head.bias": "lm_head.bias", "binary_head.weight": "binary_head.weight",
               "binary_head.bias": "binary_head.bias"},
}


def megatron_name(name: str, layout: str, arch: str, layer_offset: int) -> str:
    """Our tensor ``name`` -> Megatron's in ``layout`` ('core' or 'legacy'), a layer's index made local to its
    pipeline stage by subtracting ``layer_offset`` (the inverse of :func:`rename`)."""
    stack = ("encoder" if arch == "bert" else "decoder") if layout == "core" else "language_model.encoder"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if m and m.group(2) in LAYER_TO_MEGATRON[layout]:
        return f"{stack}.layers.{int(m.group(1)) - layer_offset}.{LAYER_TO_MEGATRON[layout][m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"final_ln\.(weight|bias)", name)
    if m:
        return f"{stack}.final_layernorm.{m.group(1)}"
    if name in FIXED_TO_MEGATRON[layout]:
        return FIXED_TO_MEGATRON[layout][name]
    raise ImportMegatronError(f"our tensor {name!r} has no Megatron-LM name in its {layout} layout")
