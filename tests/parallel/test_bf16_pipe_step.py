"""bf16 under pipeline parallelism (DeepSpeed's ``BF16_Optimizer``): the project's step
(training.optim.bf16_partitioned) against DeepSpeed's own, on two pipeline stages.

One 2-rank launch: the same training with both steps under planted non-finite gradients on one stage only (the
other stage must skip too: the norm is all-reduced over the pipeline), the host reads of the trainer's step counted
with benchmarks.host_work (DeepSpeed's step reads once or twice per step; the project's reads only to log), and a
stop and resume; then the stopped run's checkpoint resharded to PP=1 and PP=2 keeps every master and moment.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training_runs import ROOT, needs_corpus, tiny_overrides

STEPS = 12
NON_FINITE_AT = (3, 4, 8)  # one run of two skipped steps, one single skip


def _trainer(spec, run_dir, **extra):
    from training.config import load_config
    from training.resolve import resolve_run
    from training.trainer import Trainer

    ov = tiny_overrides(spec, run_dir, **{"parallel.tensor": 1, "parallel.pipeline": 2, "model.num_layers": 4,
                                          "precision.dtype": "bf16", "train.global_batch_size": 4,
                                          "optimizer.warmup_iters": 0, "optimizer.lr": 3e-3,
                                          "precision.max_consecutive_skipped": 0, "train.iters": STEPS, **extra})
    return Trainer(resolve_run(load_config(ROOT / "configs" / "gpt2_tiny.yaml", ov)))


def _steps(t, rank, first, last):
    """Trainer steps ``first``..``last - 1`` with non-finite gradients planted on stage 0 at NON_FINITE_AT, reading
    every third step; returns each step's (loss, applied, norm, skipped) and (read, host reads)."""
    from benchmarks.host_work import HostWork

    # an MLP weight of this stage's first layer (not a tied embedding: tied copies are left out of the norm)
    param = next(p for n, p in t.engine.module.named_parameters() if "mlp" in n and p.dim() == 2)
    plant = {"on": False}
    if rank == 0:  # the first stage only: the second must learn of it through the norm's all-reduce
        param.register_hook(lambda g: g * float("inf") if plant["on"] else g)
    rows, reads = [], []
    for it in range(first, last):
        plant["on"] = it in NON_FINITE_AT
        read = it % 3 == 2 or it == STEPS - 1
        with HostWork() as w:
            m = t.train_step(read=read)
        reads.append((read, w.syncs))
        if not read:
            m = t.read_metrics(m)  # outside the count: the values compared below
        rows.append((m["loss"], m["step_applied"], m["grad_norm"], m["skipped"]))
    return rows, reads


def _outcome(t, rows, reads):
    return {"rows": rows, "reads": reads, "skipped_steps": t.engine.skipped_steps,
            "weights": {n: p.detach().float().clone() for n, p in t.engine.module.named_parameters()},
            "lr_count": int(t.engine.lr_scheduler.state_dict()["last_epoch"])}


def _worker(rank, world, spec, tmp):
    from training import checkpoint as ckpt
    from training.optim.bf16_partitioned import PartitionedBf16Step

    out = {}
    for mode in ("ours", "deepspeed"):
        t = _trainer(spec, f"{tmp}/{mode}")
        out.setdefault("ours_is_partitioned", isinstance(t.engine.owned_step, PartitionedBf16Step))
        if mode == "deepspeed":
            t.engine.owned_step = None  # DeepSpeed's BF16_Optimizer.step
        out[mode] = _outcome(t, *_steps(t, rank, 0, STEPS))
    # stopped after step 6 (a skip run behind it, one ahead) and resumed in a fresh trainer
    t = _trainer(spec, f"{tmp}/resumed")
    first, _ = _steps(t, rank, 0, 6)
    t.save_checkpoint()
    t = _trainer(spec, f"{tmp}/resumed")
    assert ckpt.load(t.engine, t.state, t.ps, t.desc) and t.iteration == 6
    out["resumed"] = _outcome(t, *_steps(t, rank, 6, STEPS))
    out["resumed"]["rows"] = first + out["resumed"]["rows"]
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("bf16pipe")


@pytest.fixture(scope="module")
def runs(spm_model, base):
    return run_distributed(_worker, 2, spm_model, str(base), timeout=600)


@needs_corpus
def test_bf16_pipeline_step_equals_deepspeeds_and_skips_on_every_stage(runs):
    """The same applied and skipped steps on both stages (planted on stage 0 only), the same losses and norms, the
    same weights after twelve steps (bf16: to its precision), the LR schedule counting only applied updates."""
    applied = [k not in NON_FINITE_AT for k in range(STEPS)]
    for rank, r in enumerate(runs):
        assert r["ours_is_partitioned"]
        ours, ds = r["ours"], r["deepspeed"]
        assert [x[1] for x in ours["rows"]] == [x[1] for x in ds["rows"]] == applied, rank
        assert ours["skipped_steps"] == ds["skipped_steps"] == len(NON_FINITE_AT)
        assert [x[3] for x in ours["rows"]] == [x[3] for x in ds["rows"]]
        assert ours["lr_count"] == ds["lr_count"] == STEPS - len(NON_FINITE_AT)
        torch.testing.assert_close(torch.tensor([x[0] for x in ours["rows"]]),
                                   torch.tensor([x[0] for x in ds["rows"]]), rtol=1e-3, atol=1e-3)
        norms = [(a[2], b[2]) for a, b, ok in zip(ours["rows"], ds["rows"], applied) if ok]
        assert all(math.isfinite(a) and abs(a - b) <= 1e-4 * b for a, b in norms), norms
        assert [a[2] for a, ok in zip(ours["rows"], applied) if not ok] == [None] * len(NON_FINITE_AT)
        assert ours["weights"].keys() == ds["weights"].keys()
        for n in ours["weights"]:
            torch.testing.assert_close(ours["weights"][n], ds["weights"][n], rtol=2e-2, atol=2e-3, msg=n)
        assert ours["rows"][-1][0] < ours["rows"][0][0] - 0.2  # it learns


@needs_corpus
def test_bf16_pipeline_step_resumes_bitwise(runs):
    """Stopped after step 6 (its skip counters settled into the checkpoint) and resumed in a fresh trainer: the
    same losses, norms, skips and weights as the uninterrupted run, bitwise."""
    for r in runs:
        ours, resumed = r["ours"], r["resumed"]
        assert resumed["rows"] == ours["rows"]
        assert resumed["skipped_steps"] == ours["skipped_steps"] and resumed["lr_count"] == ours["lr_count"]
        assert all(torch.equal(resumed["weights"][n], w) for n, w in ours["weights"].items())


@needs_corpus
def test_bf16_pipeline_step_reads_the_host_only_to_log(runs):
    """The trainer's step under PP=2 in bf16: no host read on a step that does not log, one on a log step (every
    stage's metrics and bubble in one read); DeepSpeed's step read twice more per applied step (its norm check and
    its clip decision), once more per skipped one (the norm check). The first step of a stage that receives
    activations also reads the pipeline's tensor-shape handshake (DeepSpeed's, once per run), in both steps alike."""
    applied = [k not in NON_FINITE_AT for k in range(STEPS)]
    for r in runs:
        ours, ds = r["ours"]["reads"], r["deepspeed"]["reads"]
        assert ours[1:] == [(read, 1 if read else 0) for read, _ in ours[1:]], ours
        assert ds[1:] == [(read, (1 if read else 0) + (2 if ok else 1)) for (read, _), ok in zip(ds[1:], applied[1:])]
        assert ours[0][1] == ds[0][1] - 2 and ours[0][1] in (0, 4), (ours[0], ds[0])


def _state(run_dir, tag):
    """Merged fp32 masters and Adam moments, read by DeepSpeed in the run's own layout (training.tools.reshard_optim)."""
    from training.checkpoint_reader import load_merged_state_dict
    from training.tools import reshard_optim

    _, _, meta = load_merged_state_dict(run_dir, tag)
    return reshard_optim.extract(run_dir, tag, meta, run_dir.parent / f".extract_{run_dir.name}")


@needs_corpus
def test_bf16_pipeline_checkpoint_reshards_with_its_masters_and_moments(runs, base):
    """The step-6 checkpoint of the stopped run, resharded to PP=1 (bf16's unfused masters there) and to PP=2 again
    (``BF16_Optimizer``'s partitions written back): every fp32 master and Adam moment as in the source, bitwise. Read
    per parameter, ``BF16_Optimizer``'s state (keyed by its flat partitions) gave zero moments and bf16-rounded
    masters; written per parameter, the save failed."""
    from training.tools.reshard import reshard

    tag = "iter_0000006"
    src = _state(base / "resumed", tag)
    assert sum(float(s["exp_avg_sq"].abs().sum()) > 0 for s in src.values()) == len(src)
    rounded = sum(not torch.equal(s["master"], s["master"].bfloat16().float()) for s in src.values())
    assert rounded > len(src) // 2  # fp32 masters, not the bf16 weights
    for pp in (1, 2):
        out = reshard(base / "resumed", tp=1, pp=pp, out=base / f"pp{pp}", tag=tag)
        dst = _state(out, tag)
        assert sorted(dst) == sorted(src)
        for name, s in src.items():
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(dst[name][key], s[key]), (pp, name, key)
            assert float(dst[name]["step"]) == float(s["step"]) == 6 - 2  # two of the first six steps skipped
