"""``model.compile``: every transformer layer compiled in place, torchtitan-style (one graph, shared by all layers).

Each :class:`~training.models.blocks.TransformerLayer` gets ``nn.Module.compile`` (its ``__call__`` goes through
``torch.compile``; parameter names, state dicts and checkpoints are unchanged). Dynamo treats the layers'
parameters as graph inputs, so the first layer's graph serves all of them (one compilation for forward, one
for backward; activation checkpointing's no-grad forward is one more). What keeps a layer one graph: the
tensor-parallel maps count collectives only in eager mode, the CPU-only dropout/attention fast paths step
aside under compilation (``F.dropout`` and SDPA are what the compiler fuses), and the model-parallel RNG
stream is switched only around attention dropout, in one call compiled code runs eagerly
(``ParallelSelfAttention._core_on_model_parallel_stream``); ``tests/parallel/test_compile.py`` counts the graphs.
"""
from __future__ import annotations

from torch import nn

from training.models.blocks import TransformerLayer


def compile_layers(model: nn.Module, backend: str = "inductor", **options) -> int:
    """Compile every TransformerLayer of ``model`` in place (a GPT2Model, BertModel or a pipeline stage);
    returns how many. ``options`` go to ``torch.compile`` (e.g. ``mode="max-autotune-no-cudagraphs"``)."""
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile(backend=backend, **options)
    return len(layers)
