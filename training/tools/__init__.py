"""Offline tools over checkpoints: Hugging Face export/import and tensor-parallel resharding."""
