"""Every host/device path against fake CUDA tensors (``FakeTensorMode``), run as a subprocess.

    python -m tests.helpers.fake_cuda_checks WORK_DIR [--skip-move | --with-control]

Model parameters become fake ``cuda:0`` tensors; the real data loaders (GPT sampler, BERT dataset,
RACE files, WikiText windows, LAMBADA examples) feed each task's forward + loss, the validation
reduction, the parameter count, the grad norm and the evaluation scorers. The project's one batch
mover, ``training.runtime.device.to_device``, is replaced by one that makes fake CUDA copies (a CPU torch
cannot ``.to("cuda")``), so a path that skips the mover hands a host tensor to a fake CUDA one and
``FakeTensorDeviceMismatchError`` is raised. ``--skip-move`` replaces the mover by one that moves
nothing: the control that shows the checks can fail; ``--with-control`` runs both, one after the other.

Collectives in one process are identities; here they are replaced by a check that every operand is
on the fake CUDA device, after which the check stops (fake tensors have no values to read back).
Forward only, under ``no_grad``: autograd through fake CUDA tensors aborts the process, which is also
why this runs in a subprocess. One blind spot, found by reverting the fixes: FakeTensorMode lets a host
0-dim tensor absorb a CUDA scalar in place (``total += loss``) and then reports it as CUDA, so a host
accumulator handed to a collective passes here; the emulated-CUDA guard test
(tests/helpers/device_guard.py) catches exactly that case. Prints one JSON line per check: {"check", "control", "ok", "error"}.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from tests.helpers.distributed import SHARED_DATA

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(SHARED_DATA)
GPT2 = SHARED / "tokenizers" / "gpt2"
BOTCHAN = SHARED / "corpus" / "botchan.txt"
RACE = SHARED / "eval" / "RACE"
WIKITEXT = SHARED / "eval" / "wikitext-103" / "wiki.test.tokens"
LAMBADA = SHARED / "eval" / "lambada" / "lambada_test.jsonl"


class ReachedCollective(Exception):
    """Raised by the collective stand-in once it has checked the operands' device."""


@contextlib.contextmanager
def collectives_checked(world: int = 2):
    """``dist.get_world_size`` reports ``world`` (so DP/PP reductions run) and every collective checks
    that its tensors are on CUDA, then stops the check with :class:`ReachedCollective`."""
    import torch.distributed as dist

    def check(*args, **kwargs):
        for t in list(args) + list(kwargs.values()):
            if isinstance(t, torch.Tensor) and t.device.type != "cuda":
                raise AssertionError(f"collective operand {tuple(t.shape)} {t.dtype} is on {t.device}, not cuda")
        raise ReachedCollective

    saved = {n: getattr(dist, n) for n in ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "get_world_size")}
    for n in ("all_reduce", "all_gather", "broadcast", "reduce_scatter"):
        setattr(dist, n, check)
    dist.get_world_size = lambda group=None: world
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def _expect_collective(fn, world: int = 2) -> None:
    with collectives_checked(world):
        try:
            fn()
        except ReachedCollective:
            return
    raise AssertionError("no collective was reached")


def fake_cuda(build) -> torch.nn.Module:
    """``build()`` run for real (outside the fake mode), then every parameter and buffer replaced by a
    fake cuda:0 tensor (call inside the FakeTensorMode); parameter attributes (TP tags) are kept."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        module = build()

    def fake(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda:0")

    with torch.no_grad():
        for m in module.modules():
            for name, p in list(m._parameters.items()):
                if p is not None:
                    q = torch.nn.Parameter(fake(p), requires_grad=p.requires_grad)
                    q.__dict__.update(p.__dict__)
                    m._parameters[name] = q
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = fake(b)
    return module


def fake_to_device(batch, device):
    """The stand-in for ``training.runtime.device.to_device``: a fake copy of every tensor on ``device``."""
    if isinstance(batch, torch.Tensor):
        return torch.empty_strided(batch.shape, batch.stride(), dtype=batch.dtype, device=device)
    if isinstance(batch, dict):
        return type(batch)((k, fake_to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        return type(batch)(fake_to_device(v, device) for v in batch)
    return batch


class FakeCudaIndexing(TorchFunctionMode):
    """``t[...]`` and ``t[...] = v`` on fake CUDA tensors as the aten ops they stand for.

    A CPU build cannot enter a CUDA device guard, and Python indexing takes one before it reaches
    the fake kernels; the same indexing spelled as ``unsqueeze``/``slice``/``select``/``index``
    never does. Covers basic indices (int, slice, None, Ellipsis) plus one tensor index."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and args[0].device.type == "cuda":
            out, tensor_index, dim = self._basic(args[0], args[1])
            indices = None
            if tensor_index is not None:
                if tensor_index.dtype == torch.bool:
                    # a fake mask has no values, so no count of True entries: stand in coordinates of a
                    # size fixed by the mask's shape (the same for every tensor indexed by the same mask)
                    k = max(tensor_index.numel() // 2, 1)
                    coords = torch.zeros((k, tensor_index.dim()), dtype=torch.long, device=tensor_index.device)
                    indices = list(coords.unbind(1))
                else:
                    indices = [tensor_index]
                indices = [None] * dim + indices
            if func is torch.Tensor.__getitem__:
                return out if indices is None else torch.ops.aten.index.Tensor(out, indices)
            value = args[2]
            if indices is None:
                return out.copy_(value) if isinstance(value, torch.Tensor) else out.fill_(value)
            value = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=out.dtype, device=out.device)
            torch.ops.aten.index_put_(out, indices, value)
            return None
        return func(*args, **kwargs)

    @staticmethod
    def _basic(t: torch.Tensor, index):
        items = index if isinstance(index, tuple) else (index,)
        if sum(isinstance(i, torch.Tensor) for i in items) > 1:
            raise NotImplementedError(f"fake CUDA indexing with several tensor indices: {index!r}")
        out, dim, tensor_index, tensor_dim = t, 0, None, 0
        for k, i in enumerate(items):
            if i is None:
                out, dim = out.unsqueeze(dim), dim + 1
            elif i is Ellipsis:
                rest = sum(1 for j in items[k + 1:] if j is not None and j is not Ellipsis)
                dim = out.dim() - rest
            elif isinstance(i, slice):
                out = torch.ops.aten.slice.Tensor(out, dim, i.start, i.stop, i.step or 1)
                dim += 1
            elif isinstance(i, int):
                out = out.select(dim, i)
            elif isinstance(i, torch.Tensor):
                if k != len(items) - 1 and any(j is not None for j in items[k + 1:] if j is not Ellipsis
                                               and not (isinstance(j, slice) and j == slice(None))):
                    raise NotImplementedError(f"fake CUDA indexing: tensor index before other indices: {index!r}")
                tensor_index, tensor_dim = i, dim
                dim += i.dim() if i.dtype == torch.bool else 1
            else:
                raise NotImplementedError(f"fake CUDA indexing with {type(i).__name__}")
        return out, tensor_index, tensor_dim


def no_move(batch, device):
    return batch


# --------------------------------------------------------------------------------------------------
def gpt_config(work: Path, **extra):
    from training.config import load_config

    ov = {"data.corpus": "null", "data.text_files": f"[{BOTCHAN}]",
          "data.tokenizer": json.dumps({"kind": "gpt2_bpe", "vocab_file": str(GPT2 / "gpt2-vocab.json"),
                                        "merges_file": str(GPT2 / "gpt2-merges.txt")}),
          "run.dir": str(work / "gpt"), "model.seq_length": "32", "train.micro_batch_size": "2",
          "train.global_batch_size": "4", "train.iters": "2", "train.eval_interval": "1", "train.eval_iters": "1",
          "parallel.tensor": "1", "optimizer.warmup_iters": "1", **extra}
    return load_config(ROOT / "configs" / "gpt2_tiny.yaml", [f"{k}={v}" for k, v in ov.items()])


class Setup:
    """Host-side objects built once, outside the fake mode (data, tokenizers, parallel state)."""

    def __init__(self, work: Path):
        from training.models.config import padded_vocab_size
        from training.parallel.state import ParallelState
        from training.tasks.gpt import GPTTask

        self.work = work
        self.ps = ParallelState(tp=1)
        self.gpt_cfg = gpt_config(work)
        self.gpt = GPTTask(self.gpt_cfg, self.ps, 1)
        self.gpt.build_data()
        self.padded = padded_vocab_size(self.gpt.tokenizer.vocab_size, 128, 1)
        self._bert = None

    @staticmethod
    def bert_padded(tok) -> int:
        from training.models.config import padded_vocab_size

        return padded_vocab_size(tok.vocab_size, 128, 1)

    def bert(self):
        """(BertTask with data, RACE dev samples) over a small sentence-level corpus of Botchan."""
        if self._bert is None:
            from megatron_ds_suite.core.race import encode_questions, read_race_split
            from tests.helpers.corpora import botchan_docs, write_bert_corpus
            from training.config import config_from_dict
            from training.tasks.bert import BertTask

            root = self.work / "bert_corpus"
            tok = write_bert_corpus(root, botchan_docs())
            cfg = config_from_dict({
                "model": {"arch": "bert", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                          "seq_length": 64},
                "parallel": {"tensor": 1}, "optimizer": {"warmup_iters": 1},
                "train": {"micro_batch_size": 2, "global_batch_size": 2, "iters": 1, "eval_iters": 1},
                "data": {"corpus": str(root), "split": "90,10,0"}, "run": {"dir": str(self.work / "bert")}})
            task = BertTask(cfg, self.ps, 1)
            task.build_data()
            qs, _ = read_race_split(RACE, "dev")
            self._bert = (task, cfg, tok, encode_questions(qs[:4], tok, 64))
        return self._bert


# --------------------------------------------------------------------------------------------------
def check_gpt_task_loss(s: Setup) -> None:
    model = fake_cuda(lambda: s.gpt.build_model(s.padded))
    for batch in list(s.gpt.micro_batches(0)) + list(s.gpt.valid_micro_batches(0)):
        loss, _ = s.gpt.loss(model, batch)
        assert loss.device.type == "cuda"


def check_gpt_task_loss_context_parallel(s: Setup) -> None:
    """The ring's CP path (split, positions, blocks) on a ring of one; the loss's all-reduce is the collective checked."""
    from training.tasks.gpt import GPTTask
    task = GPTTask(gpt_config(s.work, **{"parallel.context": 2, "parallel.context_impl": "ring",
                                         "model.attention_dropout": 0.0}), s.ps, 1)
    model = fake_cuda(lambda: task.build_model(s.padded))
    _expect_collective(lambda: task.loss(model, next(iter(s.gpt.micro_batches(0)))), world=1)


def check_gpt_pipe_forward(s: Setup) -> None:
    """The pipeline's layers on batches moved as the trainer moves them for ``train_batch``."""
    from training.models.gpt2_pipe import build_gpt2_pipe
    from training.runtime import device as tdev

    pipe = fake_cuda(lambda: build_gpt2_pipe(s.gpt_cfg.model, s.padded, s.ps, seed=1))
    for batch in s.gpt.micro_batches(0):
        tokens, labels = tdev.to_device(batch, tdev.module_device(pipe))
        loss = pipe.loss_fn(pipe(tokens), labels)
        assert loss.device.type == "cuda"


class _Engine(torch.nn.Module):
    """What the trainer's validation needs of a DeepSpeed engine: call, eval/train, parameters."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


def check_trainer_validation_reduction(s: Setup) -> None:
    from training.trainer import Trainer

    trainer = object.__new__(Trainer)
    trainer.cfg, trainer.task, trainer.pipe, trainer.ps, trainer.dp = s.gpt_cfg, s.gpt, False, s.ps, 1
    trainer.engine = _Engine(fake_cuda(lambda: s.gpt.build_model(s.padded)))
    _expect_collective(trainer.evaluate)


def check_parameter_count_under_pp(s: Setup) -> None:
    from types import SimpleNamespace

    from training.trainer import count_parameters

    model = fake_cuda(lambda: s.gpt.build_model(s.padded))
    ps = SimpleNamespace(dims=SimpleNamespace(tp=1, pp=2), pp_group=None)
    _expect_collective(lambda: count_parameters(model, ps))


def check_grad_norm(s: Setup) -> None:
    from training.parallel.grad_norm import grad_norm

    model = fake_cuda(lambda: s.gpt.build_model(s.padded))
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    _expect_collective(lambda: grad_norm(model.parameters(), 0, tp_group=object()))


def check_bert_task_loss(s: Setup) -> None:
    """BertTask.loss up to ``bert_loss``: a stand-in checks that the MLM loss, SOP logits and SOP labels are all on CUDA."""
    import training.tasks.bert as bt

    task, cfg, tok, _ = s.bert()
    model = fake_cuda(lambda: task.build_model(s.bert_padded(tok)))
    seen = []

    def loss_inputs_on_cuda(lm_loss, sop_logits, sop_labels):
        seen.append((lm_loss.device.type, sop_logits.device.type, sop_labels.device.type))
        return lm_loss + F.cross_entropy(sop_logits.float(), sop_labels), {}

    import torch.nn.functional as F

    real = bt.bert_loss
    bt.bert_loss = loss_inputs_on_cuda
    try:
        for batch in list(task.micro_batches(0)) + list(task.valid_micro_batches(0)):
            loss, _ = task.loss(model, batch)
            assert loss.device.type == "cuda"
    finally:
        bt.bert_loss = real
    assert seen and all(d == ("cuda", "cuda", "cuda") for d in seen), seen


def check_race_finetune_forward_and_accuracy_reduction(s: Setup) -> None:
    from megatron_ds_suite.core.race import collate
    from training.models.bert import BertMultipleChoice
    from training.tasks.race import choice_logits, choice_loss

    task, cfg, tok, samples = s.bert()
    engine = _Engine(fake_cuda(lambda: BertMultipleChoice(cfg.model, s.bert_padded(tok), None)))
    loss = choice_loss(engine, collate(samples[:2]))
    assert loss.device.type == "cuda"
    assert choice_logits(engine, collate(samples[2:4])).shape == (2, 4)


def check_race_scorer(s: Setup) -> None:
    from evaluation.race_model import multiple_choice_logits
    from megatron_ds_suite.core.race import collate
    from training.models.bert import BertMultipleChoice

    task, cfg, tok, samples = s.bert()
    model = fake_cuda(lambda: BertMultipleChoice(cfg.model, s.bert_padded(tok), None)).eval()
    assert multiple_choice_logits(model, collate(samples), torch.device("cuda:0")).device.type == "cpu"


def _gpt_scorer(s: Setup):
    from evaluation.scoring import gpt2_scorer

    model = fake_cuda(lambda: s.gpt.build_model(s.padded)).eval()
    return gpt2_scorer(model, s.gpt.tokenizer.vocab_size, s.gpt_cfg.model.positions, torch.device("cuda:0"))


def check_wikitext_scoring_and_dp_reduction(s: Setup) -> None:
    import numpy as np

    from evaluation.detokenizer import get_detokenizer
    from evaluation.wikitext import WindowPlan, first_lines, score_stream

    text = first_lines(WIKITEXT.read_text(encoding="utf-8"), 12)
    tokens = np.asarray(s.gpt.tokenizer.encode(get_detokenizer("wikitext")(text)), dtype=np.int64)
    plan = WindowPlan(tokens, 32, 16, s.gpt.tokenizer.eod)
    scorer = _gpt_scorer(s)
    _expect_collective(lambda: score_stream(scorer, plan, 2, 0, 1, object(), progress=False))


def check_lambada_scoring(s: Setup) -> None:
    """The LAMBADA batch (context + target, right-padded, target mask) through the scorer; its DP sum
    reads values back (not possible on fake tensors) and is covered by the collective-guard test."""
    from evaluation.lambada import build_examples, read_lambada_jsonl

    examples = build_examples(read_lambada_jsonl(LAMBADA)[:3], s.gpt.tokenizer, strict=True)
    scorer = _gpt_scorer(s)
    width = min(max(len(e.context) + len(e.target) for e in examples), scorer.max_length + 1)
    toks = torch.full((len(examples), width), s.gpt.tokenizer.eod, dtype=torch.long)
    mask = torch.zeros((len(examples), width - 1), dtype=torch.bool)
    for r, e in enumerate(examples):
        seq = (e.context + e.target)[-width:]  # the model's positions, cut from the left as score_lambada does
        toks[r, :len(seq)] = torch.tensor(seq)
        mask[r, len(seq) - 1 - len(e.target):len(seq) - 1] = True
    nll, ok = scorer.score(toks[:, :-1], toks[:, 1:], mask)
    assert nll.device.type == "cpu" and ok.shape == mask.shape


def check_sdpa_is_causal_on_cuda(s: Setup) -> None:
    """GPT attention on CUDA half precision: SDPA with is_causal and no explicit mask (flash kernels)."""
    import torch.nn.functional as F

    calls = []
    original = F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((attn_mask is None, is_causal, q.device.type, q.dtype))
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    model = fake_cuda(lambda: s.gpt.build_model(s.padded).half()).train()
    F.scaled_dot_product_attention = record
    try:
        s.gpt.loss(model, next(iter(s.gpt.micro_batches(0))))
    finally:
        F.scaled_dot_product_attention = original
    assert calls and all(c == (True, True, "cuda", torch.float16) for c in calls), calls


CHECKS = [check_gpt_task_loss, check_gpt_task_loss_context_parallel, check_gpt_pipe_forward, check_trainer_validation_reduction,
          check_parameter_count_under_pp, check_grad_norm, check_bert_task_loss,
          check_race_finetune_forward_and_accuracy_reduction, check_race_scorer,
          check_wikitext_scoring_and_dp_reduction, check_lambada_scoring, check_sdpa_is_causal_on_cuda]


def run_checks(s: Setup, control: bool) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from training.runtime import device as tdev

    tdev.to_device = no_move if control else fake_to_device
    for check in CHECKS:
        with FakeTensorMode(allow_non_fake_inputs=True), FakeCudaIndexing(), torch.no_grad():
            try:
                check(s)
                res = {"check": check.__name__, "control": control, "ok": True, "error": None}
            except Exception as e:  # noqa: BLE001 - reported to the parent test
                res = {"check": check.__name__, "control": control, "ok": False,
                       "error": f"{type(e).__name__}: {e}"[:600], "trace": traceback.format_exc()[-1500:]}
        print(json.dumps(res), flush=True)


def main(argv: list[str]) -> int:
    from tests.helpers.distributed import free_port
    from training.runtime.distributed import init_distributed

    work = Path(argv[0])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed("gloo")
    s = Setup(work)
    s.bert()  # host work (sentencepiece, dataset maps) before any fake mode
    run_checks(s, control="--skip-move" in argv)
    if "--with-control" in argv:
        run_checks(s, control=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
