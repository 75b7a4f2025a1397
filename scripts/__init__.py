"""Project tools run as modules from the repository root (``python -m scripts.gpu_check``)."""
