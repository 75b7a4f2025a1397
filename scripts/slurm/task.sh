#!/usr/bin/env bash
# One Slurm task (srun starts one per GPU): Slurm's task numbers become the rendezvous variables every entry point
# reads (RANK, WORLD_SIZE, LOCAL_RANK; MASTER_ADDR and MASTER_PORT come from the sbatch script), then the module runs.
#   srun bash scripts/slurm/task.sh training.pretrain --config CONFIG [key=value ...]
set -euo pipefail
: "${SLURM_PROCID:?run under srun}" "${SLURM_NTASKS:?run under srun}" "${SLURM_LOCALID:?run under srun}"
: "${MASTER_ADDR:?export MASTER_ADDR (the first node) before srun}" "${MASTER_PORT:?export MASTER_PORT before srun}"
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
exec "${PYTHON:-.venv/bin/python}" -m "$@"
