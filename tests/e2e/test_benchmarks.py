"""The benchmark scripts run, and their accounting is right (tiny sizes; no timing is asserted)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.bench_runs import BENCH_RUNS, bench_all
from tests.helpers.distributed import SHARED_DATA, run_distributed


@pytest.mark.parametrize("b,s,h,n,layers,vocab", [(4, 256, 384, 6, 6, 50304), (2, 64, 96, 4, 3, 1024),
                                                  (8, 1024, 1536, 16, 40, 50304)])
def test_gemm_bound_counts_exactly_the_model_flops(b, s, h, n, layers, vocab):
    from benchmarks.bench_step_parts import step_gemms
    from training.plan.accounting import model_flops_per_iteration

    total = 0
    for _, count, sa, sb in step_gemms(b, s, h, n, layers, vocab):
        a = sa[1:] if sa[0] == "T" else sa
        bm = sb[1:] if sb[0] == "T" else sb
        assert a[-1] == bm[-2], (sa, sb)                       # inner dimensions agree
        batch = a[0] if len(a) == 3 else 1
        total += count * 2 * batch * a[-2] * a[-1] * bm[-1]
    assert total == model_flops_per_iteration(b, s, layers, h, vocab)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """({run name: bench_train_step's report}, the timed fp16 steps, the dtype A/B's JSON path), one launch."""
    ab_json = tmp_path_factory.mktemp("bench") / "ab.json"
    runs = {**BENCH_RUNS, "dtype_ab": BENCH_RUNS["dtype_ab"] + [str(ab_json)]}
    texts, timed = run_distributed(bench_all, 1, runs, 2, timeout=300 * len(runs))[0]
    return texts, timed, ab_json


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_train_step_benchmark_runs_both_models(bench, dtype):
    text = bench[0][dtype]
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert {"ours", "ours (engine default)", "hf"} <= set(rows), text
    assert "Speed-up ours/HF" in text and f"{dtype} on cpu" in text
    if dtype == "fp16":  # warm-up ran until loss scaling stopped skipping (steps skipped after it are not timed)
        assert all(int(rows[m].rstrip(" |").split("|")[-1].split("(")[1].split(")")[0]) > 0 for m in ("ours", "hf"))


def test_train_step_benchmark_llama_same_weights_same_first_loss(bench):
    """--model llama: our Llama-style GPT (RoPE, RMSNorm, SwiGLU, GQA, untied, no biases) and LlamaForCausalLM
    with the same weights, both timed and counted; their first-step losses agree (else the run stops)."""
    text = bench[0]["llama"]
    rows = {line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")}
    assert {"ours", "hf"} <= rows, text
    assert "Llama-style (ours: RoPE base 10000, RMSNorm, SwiGLU MLP 256, 2 key/value groups, output layer untied" in text
    assert "(equal within 0.0001 relative)" in text and "Host work per step" in text
    from training.plan.accounting import model_flops_per_iteration

    # the Llama count (MLP 256 gated, 2 of 4 heads' keys/values), not GPT-2's
    flops = model_flops_per_iteration(2, 16, 1, 32, 384, ffn=256, kv_hidden=16, gated=True)
    assert f"model FLOPs per step: {flops / 1e12:.4g} TFLOP" in text
    assert flops != model_flops_per_iteration(2, 16, 1, 32, 384)


def test_train_step_benchmark_llama_arguments_and_loss_check():
    from benchmarks import bench_train_step as b

    args = b.parse_args(["--model", "llama"])
    assert (args.layers, args.hidden, args.heads, args.kv_groups, args.seq, args.dropout) == (3, 96, 6, 2, 64, 0.0)
    m = b.project_config(args).model
    assert (m.ffn_size, m.query_groups, m.normalization, m.activation, m.position_embedding) == \
        (256, 2, "rmsnorm", "swiglu", "rope")
    assert m.untie_embeddings_and_output_weights and not m.add_bias_linear
    big = b.project_config(b.parse_args(["--preset", "llama-1b"])).model
    assert (big.ffn_size, big.query_groups, big.rotary_base, big.untie_embeddings_and_output_weights) == \
        (8192, 8, 500000, False)
    assert b.parse_args([]).model == "gpt2" and b.parse_args([]).dropout == 0.1
    for argv in (["--model", "llama", "--kv-groups", "4"], ["--model", "llama", "--dropout", "0.1"],
                 ["--kv-groups", "2"], ["--model", "gpt2", "--preset", "llama-1b"]):
        with pytest.raises(SystemExit):
            b.parse_args(argv)
    assert "equal within" in b.check_first_losses({"ours": 5.0, "hf": 5.0 + 1e-6}, "fp32")
    with pytest.raises(SystemExit, match="DIFFERENT"):
        b.check_first_losses({"ours": 5.0, "hf": 5.01}, "fp32")


def test_train_step_benchmark_step_ab_and_counts(bench):
    """The optimizer-step A/B on CPU (fp16): both candidates timed, and per step ours reads the device never (skip
    and loss scale decided on the device, issue 40) where DeepSpeed's own step reads it once per parameter tensor
    (1 layer: 12 + 4 tensors)."""
    text = bench[0]["step_ab"]
    assert "O(1) optimizer step vs DeepSpeed's" in text and "Host work per step" in text
    counts = text[text.index("Host work per step"):]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in counts.splitlines() if line.startswith("| ours")}
    assert float(rows["ours"][2]) == 0.0
    assert float(rows["ours (DeepSpeed step)"][2]) >= 16
    assert int(rows["ours (DeepSpeed step)"][1].replace(",", "")) > int(rows["ours"][1].replace(",", ""))


def _counts_rows(text: str) -> dict[str, list[str]]:
    """The host-work table of a --counts run: model -> [operators, kernel operators, host syncs, skipped]."""
    counts = text[text.index("Host work per step"):]
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in counts.splitlines() if line.startswith("| ours")}


def _timing_rows(text: str) -> dict[str, list[str]]:
    """The timing table (the first table): model -> its cells."""
    timing = text[:text.index("Host work per step")] if "Host work per step" in text else text
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in timing.splitlines() if line.startswith("| ") and not line.startswith("| model")}


def _ratio(text: str, prefix: str) -> float:
    """The median of a 'PREFIX ...: 1.234 [lo-hi]' A/B line."""
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return float(line.rsplit(": ", 1)[1].split(" ")[0])


def test_train_step_benchmark_dtype_ab_in_one_process(bench):
    """--dtype bf16 --dtype-ab fp16 --step-ab: bf16 with the O(1) step, bf16 with DeepSpeed's step and fp16 with
    the O(1) step, interleaved in one process. Per step (not a log step) the O(1) step reads the device never, in
    bf16 and fp16 alike (skip, clip and fp16's loss scale decided on the device), where DeepSpeed's bf16
    step reads once per parameter tensor (1 layer: 12 + 4) and dispatches more operators."""
    text, ab_json = bench[0]["dtype_ab"], bench[2]
    timing = _timing_rows(text)
    assert list(timing) == ["ours", "ours (DeepSpeed step)", "ours (fp16)"], text
    medians = json.loads(ab_json.read_text())["rows"]
    assert [medians[k]["dtype"] for k in timing] == ["bf16", "bf16", "fp16"]
    for name, cells in timing.items():  # the JSON holds the table's medians
        assert f"{medians[name]['step_time_s']:.3f}" == cells[0].split()[0]
    assert all(float(r[0].split()[0]) > 0 for r in timing.values())  # s/step
    assert "candidate 'ours (fp16)' in fp16 with AdamW torch" in text
    assert "measured bf16 and fp16 matmul peak" in text
    assert _ratio(text, "bf16 vs fp16 (fp16 step time / bf16's, ours)") > 0
    assert _ratio(text, "O(1) optimizer step vs DeepSpeed's") > 0
    rows = _counts_rows(text)
    assert float(rows["ours"][2]) == 0.0 and float(rows["ours (fp16)"][2]) == 0.0
    assert float(rows["ours (DeepSpeed step)"][2]) >= 16
    assert int(rows["ours (DeepSpeed step)"][1].replace(",", "")) > int(rows["ours"][1].replace(",", ""))
    assert int(rows["ours (fp16)"][3]) == 0  # warmed up past fp16's skipped steps before counting


def test_train_step_benchmark_compile_ab(bench):
    """--compile: eager and compiled layers (inductor, one graph per layer) timed in one process; the host-work
    counter cannot see compiled frames (dynamo runs none under a TorchDispatchMode), so their counts say n/a."""
    text = bench[0]["compile"]
    timing = _timing_rows(text)
    assert list(timing) == ["ours", "ours (compiled)"], text
    assert _ratio(text, "Compiled layers vs eager") > 0
    rows = _counts_rows(text)
    assert rows["ours (compiled)"][:3] == ["n/a"] * 3 and "ours (compiled): n/a = not countable" in text
    assert int(rows["ours"][1].replace(",", "")) > 0 and float(rows["ours"][2]) == 0.0  # fp32: no host read


def test_train_step_benchmark_refuses_what_it_cannot_compare(capsys):
    from benchmarks import bench_train_step as b

    with pytest.raises(SystemExit, match=r"^bench_train_step: --adam-ab needs --device cuda \(DeepSpeed's FusedAdam"):
        b.parse_args(["--adam-ab"])
    with pytest.raises(SystemExit):
        b.parse_args(["--dtype", "bf16", "--dtype-ab", "bf16"])
    assert "--dtype-ab bf16 is --dtype itself" in capsys.readouterr().err
    assert b.adam_for("cpu", "fp16", "auto") == "torch" and b.adam_for("cuda", "fp16", "torch") == "torch"


def test_gpu_step_script_cpu_mode(tmp_path):
    """benchmarks/gpu_step.sh with GPU_STEP_DEVICE=cpu, short (two stages): the fp16 A/B stage runs the benchmark
    (ours, DeepSpeed's step, HF, then the counts: 1 read per step for ours and for HF under the same O(1) step,
    at least one per parameter tensor for DeepSpeed's: 2 layers x 12 + 4 = 28 tensors), and the
    FusedAdam stage says why it cannot run on CPU."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHON": sys.executable, "GPU_STEP_DEVICE": "cpu", "OUT": str(tmp_path),
           "GPU_STEP_STAGES": "fp16_ab adam_ab"}
    proc = subprocess.run(["bash", str(root / "benchmarks" / "gpu_step.sh")], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "== fp16_ab: exit 0 after" in proc.stdout, proc.stdout[-3000:]
    assert "== adam_ab: skipped on CPU (DeepSpeed's FusedAdam is a CUDA kernel)" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adam_ab.txt", "fp16_ab.txt"]  # no other stage ran
    text = (tmp_path / "fp16_ab.txt").read_text()
    assert "2 layers, hidden 64, 4 heads, seq 32" in text and "fp16 on cpu" in text
    assert list(_timing_rows(text)) == ["ours", "ours (DeepSpeed step)", "hf"], text
    assert _ratio(text, "O(1) optimizer step vs DeepSpeed's") > 0
    counts = text[text.index("Host work per step"):]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in counts.splitlines() if line.startswith("| ") and not line.startswith("| model")}
    assert float(rows["ours"][2]) == 0.0 and float(rows["hf"][2]) == 0.0
    assert float(rows["ours (DeepSpeed step)"][2]) >= 28
    assert int(rows["ours (DeepSpeed step)"][0].replace(",", "")) > 2 * int(rows["ours"][0].replace(",", ""))


def test_profile_mode_profiles_applied_fp16_steps(bench):
    text = bench[0]["profile"]
    head = next(line for line in text.splitlines() if line.startswith("=== ours: 2 steps"))
    assert "0 skipped by fp16 loss scaling" in head, head  # warmed up past the skips from 2^32 first
    assert "ours.optimizer_step" in text


def test_timing_excludes_steps_that_fp16_skips(bench):
    """The H200 run of 2026-11-26 timed skipped fp16 steps (no optimizer update, ~25 % faster) into the
    fastest repetition; only applied steps are timed now, each skipped one is run again untimed."""
    seconds, total, skipped = bench[1]  # 2 applied steps
    assert skipped > 0 and total - skipped == 2 and seconds > 0


def test_eval_benchmark_candidates_agree():
    import contextlib
    import io
    from pathlib import Path

    if not (Path(SHARED_DATA) / "eval" / "wikitext-103" / "wiki.test.tokens").is_file():
        pytest.skip("../shared/data/eval/wikitext-103 not present")
    from benchmarks import bench_eval

    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # asserts inside: every candidate gives the same total NLL
        bench_eval.main(["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "64", "--windows", "4",
                         "--batches", "1,4", "--reps", "1"])
    text = out.getvalue()
    assert "scored positions, batch 4" in text and "full logits, batch 1" in text


def test_plan_fidelity_benchmark_calibrates_on_one_config_and_predicts_the_others(tmp_path, capsys):
    from benchmarks import bench_plan_fidelity

    out = tmp_path / "fidelity.json"
    bench_plan_fidelity.main(["--hidden", "32", "--layers", "1", "2", "--seq", "16", "--tp", "1", "--heads", "2",
                              "--batch", "2", "--vocab", "256", "--steps", "1", "--warmup", "1", "--reps", "1",
                              "--json", str(out)])
    text = capsys.readouterr().out
    # --json: every launch's (wall, CPU) and the constants, for re-evaluating the model without re-measuring
    d = json.loads(out.read_text())
    assert [(r["hidden"], r["layers"], r["seq"], r["tp"]) for r in d["launches"]] == [(32, 1, 16, 1), (32, 2, 16, 1)]
    assert all(len(r["wall_cpu_s"]) == 1 for r in d["launches"]) and set(d["overheads"]) == {"1"}
    assert f"| 32 | 1 | 16 | 1 | {d['launches'][0]['wall_cpu_s'][0][0]:.4f} |" in text
    rows = [[c.strip() for c in line.strip("| \n").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| hidden")]
    assert [r[:4] for r in rows] == [["32", "1", "16", "1"], ["32", "2", "16", "1"]], text
    calib, other = rows
    assert calib[8] == calib[10] == "calibration" and calib[4] == calib[7] == calib[9]
    # twice the layers: the planner predicts more time than the calibration run, in both columns
    assert float(other[7]) > float(calib[7]) and float(other[9]) > float(calib[9])
    measured, predicted = float(other[4]), float(other[7])
    # error % from the unrounded times; the printed ones are rounded to 0.1 ms (steps of ~2 ms here)
    assert float(other[8]) == pytest.approx((predicted - measured) / measured * 100, abs=8)
    # the model with the measured fixed overhead: calibrated too (or left out, "n/a", when the calibration
    # run was not slower than the overhead alone), and the overhead is reported
    assert calib[12] == "calibration" or calib[11:] == ["n/a", "n/a"]
    assert "fixed overhead" in text and " ms per layer per micro-batch" in text
    # --replay: the same report from the saved document, nothing measured
    bench_plan_fidelity.main(["--replay", str(out)])
    replayed = capsys.readouterr().out
    assert replayed.split("| hidden")[1] == text.split("| hidden")[1]
    assert f"- replayed from {out}" in replayed and f"- git: {d['machine']['git']}" in replayed


def test_plan_fidelity_in_step_latency_and_replay_of_a_sweep_the_planner_made(tmp_path, capsys):
    """A sweep whose step times ARE the planner's, with fraction 0.6, TP = 1's fixed costs at both degrees
    and the TP = 2 all-reduces at the in-step latency (the tiny model's extra 8 ms per layer at TP = 2 over its
    4 all-reduces of 2 ring steps: 1 ms), replays with every error 0 and fraction 0.600 in the full model;
    the other columns, without those terms, do not."""
    import dataclasses

    from benchmarks import bench_plan_fidelity
    from training.layout import Layout
    from training.plan.accounting import ModelShape
    from training.plan.timing import TimeModel, step_time
    from training.runtime.hardware import get_hardware

    overheads = {1: (1.3e-3, 0.5e-3), 2: (2.0e-3, 8.5e-3)}
    assert bench_plan_fidelity.in_step_alpha(overheads, 2) == pytest.approx(1e-3)
    assert bench_plan_fidelity.in_step_alpha({1: (1e-3, 0.5e-3), 4: (1e-3, 12.5e-3)}, 4) == pytest.approx(0.5e-3)
    assert bench_plan_fidelity.in_step_alpha(overheads, 1) == 0.0
    hw = dataclasses.replace(get_hardware("cpu"), peak_tflops={"fp32": 0.1}, intra_node_gbs=2.0, hbm_gbs=50.0,
                             gpus_per_node=2)
    launches = []
    for h, l, s, tp in [(128, 2, 64, 1), (128, 4, 128, 1), (256, 2, 64, 1), (128, 2, 64, 2), (256, 4, 128, 2)]:
        tm = TimeModel(alpha_intra_s=1e-3 if tp == 2 else 7e-4, memory_efficiency=1.0, overhead_step_s=1.3e-3,
                       overhead_layer_s=0.5e-3)
        shape = ModelShape(arch="gpt2", num_layers=l, hidden=h, heads=4, seq=s, vocab=8192, positions=s, ffn=4 * h)
        t = step_time(shape, Layout(tp=tp, pp=1, dp=1, micro_batch=4, global_batch=4), hw, tm, ckpt=False,
                      dtype="fp32", compute_fraction=0.6).total
        launches.append({"hidden": h, "layers": l, "seq": s, "tp": tp, "wall_cpu_s": [[t * 1.1, t], [t, t]]})
    doc = {"args": {"device": "cpu", "dtype": "fp32", "heads": 4, "batch": 4, "vocab": 8192, "steps": 5,
                    "warmup": 2, "reps": 2},
           "peak_tflops": 0.1, "alpha_s": 7e-4, "beta_bytes_s": 2e9, "elementwise_bytes_s": 5e10,
           "overheads": {str(k): list(v) for k, v in overheads.items()}, "padded_vocab": 8192,
           "calibrate": [128, 4, 128, 1], "launches": launches}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(doc))
    bench_plan_fidelity.main(["--replay", str(path)])
    text = capsys.readouterr().out
    assert "calibrated on h 128, l 4, s 128, TP 1: compute fraction" in text and "0.600 (+ links + overhead)" in text
    assert "in-step all-reduce alpha TP 2: 1000 us per ring step" in text
    rows = [[c.strip() for c in line.strip("| \n").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| hidden")]
    assert len(rows) == 5 and all(r[5] == "+10 %" for r in rows)
    full = [r[12] for r in rows if r[:4] != ["128", "4", "128", "1"]]
    assert all(abs(float(e)) < 0.05 for e in full), full
    assert "4 of 4 within 20 %" in text.split("+ links + overhead, over")[1]
    # without the in-step latency and the TP = 1 fixed costs the TP = 2 rows are off
    assert all(abs(float(r[10])) > 1.0 for r in rows if r[3] == "2")


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


# the CPU sweeps of 2026-11-26 (docs/plan.md): "+ links + overhead" within 20 % of the measured step, of 15
@pytest.mark.parametrize("run, within, worst", [(1, 15, 14.8), (2, 15, 19.0), (3, 15, 16.8), (4, 15, 14.1),
                                               (5, 10, 26.0), (6, 15, 13.4)])
def test_plan_fidelity_of_the_recorded_cpu_sweeps(run, within, worst, capsys):
    """The planner's step-time model re-evaluated on the measured sweeps kept in benchmarks/results: a change
    to training.plan that moves its predictions shows here (the counts of docs/plan.md)."""
    from benchmarks import bench_plan_fidelity

    bench_plan_fidelity.main(["--replay", str(RESULTS / f"plan_fidelity_cpu_{run}.json")])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("- |error| + links + overhead"))
    assert line.endswith(f"max {worst:.1f} %, {within} of 15 within 20 %"), line


def test_plan_fidelity_table_in_the_docs_is_the_recorded_run(capsys):
    from benchmarks import bench_plan_fidelity

    bench_plan_fidelity.main(["--replay", str(RESULTS / "plan_fidelity_cpu_6.json")])
    table = "| hidden" + capsys.readouterr().out.split("| hidden")[1].rstrip("\n")
    assert table in (RESULTS.parents[1] / "docs" / "plan.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda", "--tp", "1", "2"], "--tp 1 only (NCCL allows one rank per GPU)"),
    (["--dtype", "fp16"], "--device cpu measures fp32"),
])
def test_plan_fidelity_refuses_what_it_cannot_measure(argv, message, capsys):
    from benchmarks import bench_plan_fidelity

    with pytest.raises(SystemExit) as e:
        bench_plan_fidelity.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_plan_fidelity_replay_of_a_missing_file_is_one_line(tmp_path, capsys):
    from benchmarks import bench_plan_fidelity

    with pytest.raises(SystemExit) as e:
        bench_plan_fidelity.parse_args(["--replay", str(tmp_path / "none.json")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.endswith(f"--replay {tmp_path / 'none.json'}: no such file (write one with --json)")


def test_tokenize_benchmark_checks_the_word_cache_against_sentencepiece(capsys):
    pytest.importorskip("sentencepiece")
    from benchmarks import bench_corpus, bench_tokenize

    if not (bench_corpus.DATA / "botchan.txt").is_file():
        pytest.skip("../shared/data corpus absent")
    bench_tokenize.main(["--docs", "300", "--vocab", "1000", "--batch", "64", "--reps", "1"])
    text = capsys.readouterr().out  # the ids are asserted equal inside
    rows = {r[0]: r for r in ([c.strip() for c in line.strip("| \n").split("|")] for line in text.splitlines()
                              if line.startswith("| ") and not line.startswith("| tokenizer"))}
    assert {"SentencePiece Encode", "word cache, cold", "word cache, warm"} <= set(rows)
    assert rows["SentencePiece Encode"][4] == "1.00x" and float(rows["word cache, warm"][1]) > 0



_CORPORA = Path(SHARED_DATA) / "corpus"
needs_corpora = pytest.mark.skipif(not ((_CORPORA / "botchan.txt").is_file() and (_CORPORA / "tinyshakespeare.txt")
                                        .is_file()), reason="../shared/data/corpus absent")


@needs_corpora
def test_e2e_datatrove_truth_pairs_match_brute_force():
    import itertools

    from benchmarks.bench_corpus import DATA, markov_corpus, real_words
    from benchmarks.bench_e2e_datatrove import similar_pairs
    from data_pipeline import dedup as dd
    from data_pipeline.planted import planted_corpus

    words = real_words([DATA / "botchan.txt", DATA / "tinyshakespeare.txt"])
    planted, _ = planted_corpus(words, 25, 4, max_edit_frac=0.12, seed=3)  # Jaccards spread over ~0.3-1.0
    # a prefix of a document at Jaccard exactly 0.7, 0.69 and 0.5 to it: the pairs on which the prefix-filter bound
    # is tight (the longer one's rarest shingles are its own, so only its last prefix slot holds a shared one)
    base = [f"w{k}" for k in range(104)]  # 100 distinct shingles
    cut = [" ".join(base[:m + 4]) for m in (70, 69, 50)]
    texts = planted + markov_corpus(words, 150, seed=5) + ["short text", "", planted[0], " ".join(base)] + cut
    spec = dd.ShingleSpec(5, "word")
    sets = [dd.shingle_set(t, spec) for t in texts]
    brute = {(i, j): dd.jaccard(sets[i], sets[j]) for i, j in itertools.combinations(range(len(texts)), 2)}
    for t in (0.7, 0.5):
        want = {p: v for p, v in brute.items() if v >= t}
        got = similar_pairs(texts, t)
        assert set(got) == set(want) and len(want) > 20
        assert all(abs(got[p] - want[p]) < 1e-12 for p in want)
        assert any(v < 0.8 for v in want.values())  # pairs near the threshold are in play
        n = len(texts)
        assert ((n - 4, n - 3) in got) and ((n - 4, n - 2) in got) == (t == 0.5) and ((n - 4, n - 1) in got) == (t == 0.5)


@needs_corpora
def test_e2e_datatrove_benchmark_runs_ours_and_skips_datatrove_cleanly(capsys):
    import sys

    from benchmarks import bench_e2e_datatrove

    # this venv has no datatrove: the comparison is skipped with a message, ours still runs and is scored
    bench_e2e_datatrove.main(["--docs", "300", "--workers", "2", "--datatrove-python", sys.executable])
    text = capsys.readouterr().out
    assert "datatrove skipped:" in text and "cannot import datatrove" in text
    row = [c.strip() for c in next(x for x in text.splitlines() if x.startswith("| ours")).strip("| ").split("|")]
    kept, tokens, recall, low = int(row[7]), int(row[8]), float(row[9]), int(row[10])
    assert 200 < kept < 300 and tokens > kept * 128 and recall >= 0.95 and low >= 0
    assert "data_pipeline build --config" in text
