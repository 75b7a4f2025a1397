"""The process environment: devices, process groups, DeepSpeed compatibility, hardware peaks, run locks."""
