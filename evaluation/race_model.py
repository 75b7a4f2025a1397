"""Checkpoint -> RACE ``score_fn``.

Contract with the multiple-choice BERT model (fine-tuning stage): ``load_model_for_eval`` returns a
model of ``arch == "bert"`` whose call ``model(text, types, padding_mask)`` on int64 ``[n, 4, L]``
tensors returns logits ``[n, 4]`` (Megatron's ``MultipleChoice``: [n,4,L] -> [4n,L] -> BERT ->
pooler -> Linear(h, 1) -> [n, 4]).
"""
from __future__ import annotations

from pathlib import Path

import torch

from evaluation.errors import EvalError
from training.runtime import device as tdev


def load_multiple_choice(run_dir: str | Path, rt):
    p = Path(run_dir)
    if not p.is_dir():
        raise EvalError(f"checkpoint directory {p} does not exist")
    from training.checkpoint_reader import load_model_for_eval

    model, cfg, tokenizer = load_model_for_eval(p, group=rt.pstate.tp_group if rt.pstate is not None else None,
                                                device=str(rt.device))
    if cfg.model.arch != "bert" or not getattr(model, "num_choices", None):
        raise EvalError(f"{p} holds a {cfg.model.arch!r} model without a multiple-choice head; RACE needs a "
                        "BERT checkpoint fine-tuned for multiple choice")
    model.eval()

    return (lambda batch: multiple_choice_logits(model, batch, rt.device)), tokenizer


@torch.no_grad()
def multiple_choice_logits(model, batch: dict, device: torch.device) -> torch.Tensor:
    """Host ``collate`` batch -> fp32 logits [n, 4] on the host; the model runs on ``device``."""
    b = tdev.to_device(batch, device)
    return model(b["text"], b["types"], b["padding_mask"]).float().cpu()
