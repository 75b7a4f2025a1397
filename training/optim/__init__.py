"""The optimizer step the project owns, and the engine it runs in.

- :mod:`training.optim.adamw`: AdamW's parameter groups, Megatron's learning-rate schedule, the optimizer
  chosen for the device and dtype;
- :mod:`training.optim.outcome`: :class:`~training.optim.outcome.StepOutcome`, what one optimizer step did;
- :mod:`training.optim.grad_buffer`: :class:`~training.optim.grad_buffer.GradBuffer`, the gradients in one static
  buffer per dtype and the data-parallel reduction in buckets overlapped with backward;
- :mod:`training.optim.grad_layout`: the gradients of DeepSpeed's ZeRO-0 wrappers as flat fp32 groups and the
  masked global norm over them;
- :mod:`training.optim.loss_scale`: DeepSpeed's dynamic loss-scale rule;
- :mod:`training.optim.mixed_precision`: :class:`~training.optim.mixed_precision.MixedPrecisionStep`, fp16/bf16 at
  ZeRO-0 in a constant number of kernels and at most one host read;
- :mod:`training.optim.bf16_partitioned`: :class:`~training.optim.bf16_partitioned.PartitionedBf16Step`, bf16
  under pipeline parallelism (DeepSpeed's ``BF16_Optimizer``) with no host read;
- :mod:`training.optim.fp32`: :class:`~training.optim.fp32.Fp32Step`, fp32 at ZeRO-0 with the TP x PP norm;
- :mod:`training.optim.engine`: the engine builder, the one place where the project adapts DeepSpeed (a table of
  each adaptation, what it repairs and for which release).
"""
