"""Process groups for a TP x PP x DP layout, and the ``mpu`` object DeepSpeed calls.

Ranks are laid out exactly as DeepSpeed's ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)``:
rank = pipe * (dp * tp) + data * tp + model, i.e. tensor-parallel ranks are adjacent (same node),
data-parallel ranks strided by TP, pipeline stages outermost. Building the groups from that topology
object keeps our groups and DeepSpeed's pipeline grid in agreement.

Sizes are validated by :class:`ParallelDims` (a pure dataclass) before any process group exists; a bad
layout raises the suite's :class:`~megatron_ds_suite.core.errors.ConfigError` (one line, exit code 2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megatron_ds_suite.core.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """world = tp * pp * dp, checked without touching torch.distributed."""

    world_size: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel size {name}={getattr(self, name)} must be >= 1")
        if self.world_size % (self.tp * self.pp):
            raise ConfigError(f"world size {self.world_size} is not divisible by TP x PP = {self.tp} x {self.pp}: "
                              f"launch a multiple of {self.tp * self.pp} processes")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return pp_rank, dp_rank, tp_rank


class ParallelState:
    """All process groups of one layout; also the Megatron-style ``mpu`` that DeepSpeed consumes.

    ``get_model_parallel_*`` is the tensor-parallel group (DeepSpeed reduces grad norms and overflow
    flags over it and names checkpoint files ``mp_rank_XX`` after its rank), as in gpt-neox and the
    DeepSpeedExamples Megatron fork. Do not add an ``initialize_sequence_parallel`` attribute: DeepSpeed
    would take this object for a sequence-parallel mpu.
    """

    def __init__(self, tp: int = 1, pp: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised before building ParallelState")
        self.dims = ParallelDims(dist.get_world_size(), tp, pp)
        self.rank = dist.get_rank()
        self.topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=self.dims.dp)
        # Every rank must create every group, in the same order.
        self.tp_group = self._make_groups("model")
        self.dp_group = self._make_groups("data")
        self.pp_group = self._make_groups("pipe")
        self.pp_rank, self.dp_rank, self.tp_rank = self.dims.coords(self.rank)
        c = self.topology.get_coord(self.rank)
        assert (c.pipe, c.data, c.model) == (self.pp_rank, self.dp_rank, self.tp_rank)

    def _make_groups(self, axis: str) -> dist.ProcessGroup:
        mine = None
        for ranks in self.topology.get_axis_comm_lists(axis):
            g = dist.new_group(ranks=ranks)
            if self.rank in ranks:
                mine = g
        if mine is None:  # axis of size 1: one group per rank
            mine = dist.new_group(ranks=[self.rank])
        return mine

    def __repr__(self) -> str:
        d = self.dims
        return (f"ParallelState(world={d.world_size}, tp={d.tp}, pp={d.pp}, dp={d.dp}, rank={self.rank}: "
                f"tp_rank={self.tp_rank}, dp_rank={self.dp_rank}, pp_rank={self.pp_rank})")

    # ---- tensor parallel ------------------------------------------------------------------------
    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.dims.tp

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (batch broadcast source)."""
        return self.rank - self.tp_rank

    # Megatron 2020 names ("model parallel" == tensor parallel here)
    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_src_rank = get_tensor_model_parallel_src_rank

    # ---- data parallel --------------------------------------------------------------------------
    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dims.dp

    # ---- pipeline parallel ----------------------------------------------------------------------
    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup:
        return self.pp_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.dims.pp
