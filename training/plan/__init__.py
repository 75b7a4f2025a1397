"""Memory and speed planner for TP x PP x DP runs of our GPT-2 / BERT (``python -m training.plan``).

What it computes, per device, for one optimizer step (all formulas in docs/plan.md):

* parameters of every TP/PP shard, exactly as our models build them (pre-LN layers, 4h MLP with
  biases, learned positions, tied output embedding, padded vocabulary, final LayerNorm; BERT adds
  token types, pooler, LM-head dense+LN+bias and the binary head);
* memory: fp16/bf16 weights 2 B + grads 2 B + fp32 master/m/v 12 B per parameter (fp32 training:
  4 + 4 + 8), ZeRO-1 dividing the optimizer part by DP; activations per Korthikanti et al. 2022
  without recomputation, with selective recomputation (attention core) and with full checkpointing, with
  and without sequence parallelism;
* FLOPs per step (Narayanan et al. 2021 eq. 3), communication volume per step for TP, PP, DP;
* a predicted step time from an alpha-beta model (``TimeModel``; every constant documented there).

Notation: l layers, h hidden, a heads, s sequence, f MLP width (4h), V padded vocabulary, P positions,
b micro-batch, B global batch, t/p/d = TP/PP/DP degrees, m = B / (b d) micro-batches per step.

Modules (each one job; the package re-exports nothing: a caller imports each name from the module that
defines it, so that ``import training.plan.accounting`` -- what the trainer's MFU metric needs -- loads no
CLI, report or time model):

* :mod:`~training.plan.accounting` parameters and FLOPs (shared with the MFU of ``training.metrics``);
* :mod:`~training.plan.layout` whether a model shape fits a layout (the layout itself is
  :class:`training.layout.Layout`, the trainer's);
* :mod:`~training.plan.memory` weights, gradients, optimizer states and activations per device;
* :mod:`~training.plan.timing` communication volume and the step-time model;
* :mod:`~training.plan.recompute` the recomputation ``recompute: auto`` resolves to;
* :mod:`~training.plan.presets` and :mod:`~training.plan.paper` the paper's models and weak scaling;
* :mod:`~training.plan.report` the text tables; :mod:`~training.plan.cli` the command line.
"""
