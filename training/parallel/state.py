"""Process groups for a TP x CP x DP x PP layout, and the ``mpu`` object DeepSpeed calls.

Ranks are laid out exactly as DeepSpeed's ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp x cp)``:
rank = pipe * (dp * cp * tp) + data * (cp * tp) + context * tp + model, i.e. tensor-parallel ranks are adjacent
(same node), context-parallel ranks next (Megatron's order: tp, cp, dp, pp), data-parallel ranks strided by
CP x TP, pipeline stages outermost. DeepSpeed's "data" axis is the dp x cp product (Megatron's ``dp_cp`` group):
context-parallel ranks hold the same weights and see different tokens of the same samples, so their gradients
are reduced with the data-parallel ones. Building the groups from that topology object keeps our groups and
DeepSpeed's pipeline grid in agreement.

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
    """world = tp * cp * dp * pp, checked without touching torch.distributed."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel size {name}={getattr(self, name)} must be >= 1")
        model = self.tp * self.pp * self.cp
        if self.world_size % model:
            names, sizes = ("TP x CP x PP", f"{self.tp} x {self.cp} x {self.pp}") if self.cp > 1 else \
                ("TP x PP", f"{self.tp} x {self.pp}")
            raise ConfigError(f"world size {self.world_size} is not divisible by {names} = {sizes}: launch a multiple "
                              f"of {model} processes")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        tp_rank = rank % self.tp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return pp_rank, dp_rank, tp_rank

    def cp_rank(self, rank: int) -> int:
        """The context-parallel rank of a global rank (its place among the ranks sharing its samples' tokens)."""
        return (rank // self.tp) % self.cp


class ParallelState:
    """All process groups of one layout; also the Megatron-style ``mpu`` that DeepSpeed consumes.

    ``get_model_parallel_*`` is the tensor-parallel group (DeepSpeed reduces grad norms and overflow
    flags over it and names checkpoint files ``mp_rank_XX`` after its rank), as in gpt-neox and the
    DeepSpeedExamples Megatron fork. Do not add an ``initialize_sequence_parallel`` attribute: DeepSpeed
    would take this object for a sequence-parallel mpu.
    """

    def __init__(self, tp: int = 1, pp: int = 1, cp: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised before building ParallelState")
        self.dims = ParallelDims(dist.get_world_size(), tp, pp, cp)
        self.rank = dist.get_rank()
        self.topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=self.dims.dp * cp)
        # Every rank must create every group, in the same order.
        self.tp_group = self._make_groups("model")
        self.dp_cp_group = self._make_groups("data")                      # DeepSpeed's data axis: dp x cp
        self.pp_group = self._make_groups("pipe")
        self.cp_group = self._split_data_axis(lambda d: d // cp)          # CP = 1: one per rank, as other axes of 1
        self.dp_group = self._split_data_axis(lambda d: d % cp) if cp > 1 else self.dp_cp_group
        self.pp_rank, self.dp_rank, self.tp_rank = self.dims.coords(self.rank)
        self.cp_rank = self.dims.cp_rank(self.rank)
        c = self.topology.get_coord(self.rank)
        assert (c.pipe, c.data, c.model) == (self.pp_rank, self.dp_rank * cp + self.cp_rank, self.tp_rank)

    def _split_data_axis(self, key) -> dist.ProcessGroup:
        """Groups within each dp x cp "data" list of the topology, the members sharing ``key(data coordinate)``: the
        CP groups (consecutive coordinates, ``d // cp``) or the DP groups (strided by CP, ``d % cp``)."""
        mine = None
        for ranks in self.topology.get_axis_comm_lists("data"):
            for k in sorted({key(d) for d in range(len(ranks))}):
                sub = [r for d, r in enumerate(ranks) if key(d) == k]
                g = dist.new_group(ranks=sub)
                if self.rank in sub:
                    mine = g
        assert mine is not None
        return mine

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
        return (f"ParallelState(world={d.world_size}, tp={d.tp}, pp={d.pp}, dp={d.dp}, cp={d.cp}, rank={self.rank}: "
                f"tp_rank={self.tp_rank}, dp_rank={self.dp_rank}, pp_rank={self.pp_rank}, cp_rank={self.cp_rank})")

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

    # ---- context parallel: DeepSpeed's "sequence parallel" names (its engine reduces gradients over the
    # sequence-data-parallel group and divides by its size over the sequence-parallel size, i.e. by DP) ---------
    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self.cp_group

    def get_sequence_parallel_rank(self) -> int:
        return self.cp_rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.dims.cp

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        return self.dp_cp_group

    def get_sequence_data_parallel_rank(self) -> int:
        return self.dp_rank * self.dims.cp + self.cp_rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.dims.dp * self.dims.cp

    # ---- pipeline parallel ----------------------------------------------------------------------
    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup:
        return self.pp_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.dims.pp
