"""A pipeline rank's model chunks for Megatron's interleaved 1F1B schedule (Narayanan et al. 2021, Sec. 2.2).

:class:`InterleavedPipeModule` is DeepSpeed's ``PipelineModule`` cut into ``p * v`` stages of equal layer counts
(p pipeline ranks, v = ``virtual_pipeline`` chunks per rank); rank r builds stages r, r + p, ..., r + (v-1) p, as
Megatron assigns them (its ``model[k]`` on rank r is stage r + k p). Only one chunk is exposed through
``forward()`` at a time (:meth:`activate_chunk`), the way DeepSpeed's ``DualPipeVModule`` exposes one of its two
phases; the engine and schedule that run it are :mod:`training.optim.pipe_interleaved`. :func:`schedule_module` builds
a model's layer list (GPT's, :mod:`training.models.gpt2_pipe`; BERT's, :mod:`training.models.bert_pipe`) as the
module of the configured schedule.

A micro-batch flows rank 0 chunk 0 -> rank 1 chunk 0 -> ... -> rank p-1 chunk 0 -> rank 0 chunk 1 (the
wraparound) -> ... -> rank p-1 chunk v-1, which computes the loss. Layers keep their global index as their
module name and checkpoint file (``layer_XX-model_YY-model_states.pt``), so the layer files do not depend on the
schedule. A tied embedding sits in rank 0's chunk 0 and rank p-1's chunk v-1: DeepSpeed's tied group is those two
ranks, and the engine all-reduces the tied gradient over it before the step (Megatron's embedding group).
"""
from __future__ import annotations

import torch.distributed as dist
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
from deepspeed.runtime.pipe.module import PipelineModule


class InterleavedPipeModule(PipelineModule):
    """A ``PipelineModule`` holding ``virtual_pipeline`` chunks on each pipeline rank (see the module docstring).

    ``chunk_bounds[k]`` is chunk k's [start, stop) in the global layer list; ``active_chunk`` the chunk that
    ``forward()`` runs; ``scatter_group`` the TP group the engine sends stage-to-stage tensors in 1/t pieces over
    (:func:`training.parallel.pipe_scatter.scatter_group`: without sequence parallelism; None sends them whole)."""

    def __init__(self, *args, virtual_pipeline: int, scatter_group: dist.ProcessGroup | None = None, **kwargs):
        # read by _partition_layers, which PipelineModule.__init__ calls before anything else is set
        self.__dict__["virtual_pipeline"] = virtual_pipeline
        super().__init__(*args, **kwargs)
        self.scatter_group = scatter_group

    def _partition_layers(self, method="uniform"):
        self.pipe_ranks = self.num_stages
        self.num_stages *= self.virtual_pipeline  # p * v stages; stage r + k p is chunk k of rank r
        super()._partition_layers(method)
        r, p = self.stage_id, self.pipe_ranks
        self.chunk_bounds = [(self.parts[r + k * p], self.parts[r + k * p + 1]) for k in range(self.virtual_pipeline)]

    def stage_owner(self, layer_idx):
        """The pipeline rank that holds ``layer_idx`` (DeepSpeed's tied groups are built from it)."""
        return super().stage_owner(layer_idx) % self.pipe_ranks

    def _build(self):
        self.chunk_funcs, self.chunk_checkpointable = [], [[] for _ in self.chunk_bounds]
        for start, stop in self.chunk_bounds:
            self._set_bounds(start, stop)
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
            self.forward_funcs = []
        self.activate_chunk(0)

    def activate_chunk(self, chunk: int) -> None:
        """Expose chunk ``chunk``'s layers as this module's forward (and its layer range to checkpointing)."""
        self.active_chunk = chunk
        self.forward_funcs = self.chunk_funcs[chunk]
        self.is_checkpointable_results = self.chunk_checkpointable[chunk]
        self._local_start, self._local_stop = self.chunk_bounds[chunk]

    def _each_chunk(self, method, *args, **kwargs) -> None:
        for chunk in range(len(self.chunk_bounds)):
            self.activate_chunk(chunk)
            method(*args, **kwargs)
        self.activate_chunk(0)

    def _precompute_checkpointable_values(self):
        def one_chunk():
            self.is_checkpointable_results_interval = None  # DeepSpeed caches per interval, not per chunk
            PipelineModule._precompute_checkpointable_values(self)
            self.chunk_checkpointable[self.active_chunk] = self.is_checkpointable_results
        self._each_chunk(one_chunk)

    def save_state_dict(self, *args, **kwargs):
        self._each_chunk(super().save_state_dict, *args, **kwargs)

    def load_state_dir(self, *args, **kwargs):
        self._each_chunk(super().load_state_dir, *args, **kwargs)

    def compile(self, *args, **kwargs):
        self._each_chunk(super().compile, *args, **kwargs)


def schedule_module(schedule: str, virtual_pipeline: int = 1, scatter_group: dist.ProcessGroup | None = None,
                    **kwargs) -> PipelineModule:
    """The stages of ``PipelineModule(**kwargs)`` for ``schedule`` (``parallel.pipeline_schedule``): '1f1b'
    DeepSpeed's ``PipelineModule`` (one stage per rank), 'interleaved' :class:`InterleavedPipeModule`
    (``virtual_pipeline`` chunks per rank), 'dualpipev' DeepSpeed's ``DualPipeVModule`` (stages r and 2p-1-r on
    rank r, the tied embedding one module on rank 0). ``scatter_group``: the interleaved engine's scatter/gather
    group (1F1B has DeepSpeed's own, ``pipeline.pipe_partitioned``; DualPipeV sends whole tensors)."""
    if schedule == "interleaved":
        return InterleavedPipeModule(virtual_pipeline=virtual_pipeline, scatter_group=scatter_group, **kwargs)
    return (DualPipeVModule if schedule == "dualpipev" else PipelineModule)(**kwargs)
