"""``model.compile``: every transformer layer compiled in place, torchtitan-style (one graph, shared by all layers).

Each :class:`~training.models.blocks.TransformerLayer` gets ``nn.Module.compile`` (its ``__call__`` goes through
``torch.compile``; parameter names, state dicts and checkpoints are unchanged). Dynamo treats the layers'
parameters as graph inputs, so the first layer's graph serves all of them (one compilation for forward, one
for backward; activation checkpointing's no-grad forward is one more). What keeps a layer one graph: the
tensor-parallel maps count collectives only in eager mode, the CPU-only dropout/attention fast paths step
aside under compilation (``F.dropout`` and SDPA are what the compiler fuses), and attention dropout's
model-parallel RNG stream is a counter-based mask in traced ops under compilation, not a generator fork
(``training.parallel.random.model_parallel_dropout``); ``tests/parallel/test_compile.py`` counts the graphs.

``cuda_graph=True`` (``model.cuda_graph``) compiles with ``mode="reduce-overhead"``: inductor records each layer's
forward and backward graphs as CUDA graphs (torch's CUDA-graph trees) and replays them. Every random number
in the layer then comes from the default CUDA generator (the dropout seeds and the model-parallel key), which
torch registers with each capture, so replays draw fresh masks and activation checkpointing's restore of that
generator replays them. Untested on a GPU so far: ``scripts/gpu_check.sh --only cuda_graph`` is its check.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_ds_suite.core.errors import ConfigError
from training.models.blocks import TransformerLayer


def compile_layers(model: nn.Module, backend: str = "inductor", cuda_graph: bool = False, **options) -> int:
    """Compile every TransformerLayer of ``model`` in place (a GPTModel, BertModel or a pipeline stage);
    returns how many. ``options`` go to ``torch.compile`` (e.g. ``mode="max-autotune-no-cudagraphs"``);
    ``cuda_graph`` captures the layers as CUDA graphs (``mode="reduce-overhead"``; CUDA only)."""
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    if cuda_graph:
        if not torch.cuda.is_available():
            raise ConfigError("model.cuda_graph=true captures CUDA graphs: it needs a CUDA GPU (this machine has none)")
        options = {**options, "mode": "reduce-overhead"}
    for layer in layers:
        layer.compile(backend=backend, **options)
    return len(layers)
