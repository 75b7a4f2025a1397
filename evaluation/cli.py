"""``python -m evaluation {wikitext103,lambada,race,generate,heldout} --checkpoint RUN_DIR ...``

Each command prints a short table and writes its numbers as JSON (``--json OUT``; default
``RUN_DIR/eval/<task>.json``). Bad input fails before any model is loaded with one line on stderr
(exit code 2). ``--limit N`` scores only the start of the data (first N lines / examples / questions);
the JSON then has ``"limit": N`` (``null`` for a full run) and the table says so.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from evaluation import heldout, lm_eval_run
from evaluation.errors import EvalError
from evaluation.report import check_output_path, format_table
from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.errors import SuiteError
from megatron_ds_suite.core.program import prog as program
from megatron_ds_suite.core.race import encode_questions, read_race_split
from training.metrics import progress_enabled
from training.runtime.launch import shutdown

logger = logging.getLogger("evaluation")
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="run directory written by training")
    p.add_argument("--json", default=None, help="output JSON (default RUN_DIR/eval/<task>.json)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the evaluation (processes per replica)")
    p.add_argument("--device", default=None, help="torch device (default: cuda:LOCAL_RANK if available, else cpu)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: only when stderr is a terminal)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher


def _data(p: argparse.ArgumentParser, what: str) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--data", help=f"{what} file")
    g.add_argument("--hf-dataset", help="datasets name, NAME or NAME:CONFIG (hub name or local folder)")
    p.add_argument("--hf-split", default="test", help="split of --hf-dataset (default test)")


def _limit(p: argparse.ArgumentParser, unit: str) -> None:
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help=f"score only the first N {unit} (N >= 1; a limited run, marked in the JSON and table)")


def _limited(args, unit: str) -> str:
    return f" (limited: first {args.limit} {unit})" if args.limit else ""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=program("python -m evaluation"), description=__doc__.split("\n\n")[0])
    # the deepspeed launcher puts --local_rank=N before the subcommand (deepspeed --module evaluation ...)
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="task", required=True)

    w = sub.add_parser("wikitext103", help="WikiText-103 perplexity, Megatron style (overlapping windows)")
    _common(w)
    _data(w, "WikiText .tokens")
    w.add_argument("--seq-length", type=int, default=None, help="window length L (default: the model's seq_length)")
    w.add_argument("--stride", type=int, default=32, help="scored tokens per window after the first (Megatron --overlapping-eval)")
    w.add_argument("--detokenizer", default="wikitext", choices=["wikitext", "ptb", "none"])
    w.add_argument("--include-vocab-padding", action="store_true",
                   help="softmax over the padded vocabulary as Megatron does (default: real vocabulary only)")
    _limit(w, "lines of the .tokens text (the same cut as the main job's eval.wikitext103.limit_lines)")

    la = sub.add_parser("lambada", help="LAMBADA last-word accuracy")
    _common(la)
    _data(la, "LAMBADA jsonl")
    la.add_argument("--strict", action=argparse.BooleanOptionalAction, default=True,
                    help="strict: whole last word must be greedy (default); --no-strict: last BPE token only")
    la.add_argument("--include-vocab-padding", action="store_true")
    _limit(la, "examples (= JSON lines)")

    r = sub.add_parser("race", help="RACE multiple-choice accuracy (fine-tuned BERT multiple-choice checkpoint)")
    _common(r)
    r.add_argument("--data", required=True, help="RACE folder with {train,dev,test}/{middle,high}/*.txt")
    r.add_argument("--split", default="test", choices=["train", "dev", "test"])
    r.add_argument("--seq-length", type=int, default=None,
                   help="sequence length of the 4 encoded options (default: the checkpoint's seq_length)")
    _limit(r, "questions of the split (middle then high, files in sorted name order, questions in file order)")

    g = sub.add_parser("generate", help="continue prompts with a GPT checkpoint (greedy or sampled, KV cache)")
    _common(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompts", help="file: one prompt per line, or .jsonl with {\"prompt\": ...} per line")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature/top-k/top-p/seed)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most probable tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--no-stop-at-eod", action="store_true", help="keep generating after the end-of-document id")

    heldout.add_parser(sub)
    lm_eval_run.add_parser(sub)
    return ap


def output_path(args) -> Path:
    """Where a task writes its result: ``--json``, else ``RUN_DIR/eval/<task>.json`` (lm-eval: ``lm_eval.json``)."""
    name = "lm_eval" if args.task == "lm-eval" else args.task
    return Path(args.json) if args.json else Path(args.checkpoint) / "eval" / f"{name}.json"


def _finish(args, rt, title: str, rows: list, result: dict) -> None:
    if not rt.is_main:
        return
    out = output_path(args)
    result = {"task": args.task, "checkpoint": str(args.checkpoint), "limit": args.limit, **result}
    atomic.write_json(out, result)
    print(format_table(title, rows))
    print(f"wrote {out}")


def run_wikitext(args) -> None:
    from evaluation.model import load_scorer, setup_runtime
    from evaluation.tasks import wikitext_eval
    from evaluation.wikitext import first_lines, read_hf_wikitext, read_tokens_file

    if args.data:
        text = read_tokens_file(args.data, args.limit)
    else:
        text = read_hf_wikitext(args.hf_dataset, args.hf_split)
        if args.limit:
            text = first_lines(text, args.limit)
            if not text.strip():
                raise EvalError(f"the first {args.limit} line(s) of {args.hf_dataset}[{args.hf_split}] are blank")
    if len(text.split()) < 2:  # perplexity over 0 or 1 token is undefined
        raise EvalError(f"{args.data or args.hf_dataset} holds {len(text.split())} word(s): WikiText perplexity "
                        f"needs at least 2 (pass the .tokens file of a split, or a larger --limit)")
    rt = setup_runtime(args.tp, args.device)
    scorer, cfg, tok = load_scorer(args.checkpoint, rt, args.include_vocab_padding)
    L = args.seq_length or cfg.model.seq_length
    if L > cfg.model.positions:
        raise EvalError(f"--seq-length {L} exceeds the model's {cfg.model.positions} positions")
    res = wikitext_eval(scorer, tok, text, L, args.stride, args.batch_size, args.detokenizer, rt.dp,
                        progress=progress_enabled(args.progress) and rt.is_main)
    res["data"] = args.data or f"{args.hf_dataset}[{args.hf_split}]"
    rows = [("total loss (nats)", res["total_nll"]), ("model tokens N", res["num_tokenized_tokens"]),
            ("original tokens", res["num_original_tokens"]), ("loss / model token", res["loss"]),
            ("ppl (model tokens)", res["ppl"]), ("adjusted ppl (original tokens)", res["adjusted_ppl"]),
            ("windows (L, stride)", f"{res['windows']} ({L}, {args.stride})"),
            ("tokens/s", res["tokens_per_second"])]
    _finish(args, rt, "WikiText perplexity (Megatron)" + _limited(args, "lines"), rows, res)


def run_lambada(args) -> None:
    from evaluation.lambada import read_hf_lambada, read_lambada_jsonl
    from evaluation.model import load_scorer, setup_runtime
    from evaluation.tasks import lambada_eval

    texts = read_lambada_jsonl(args.data) if args.data else read_hf_lambada(args.hf_dataset, args.hf_split)
    texts = texts[:args.limit] if args.limit else texts  # the whole input is still checked
    rt = setup_runtime(args.tp, args.device)
    scorer, cfg, tok = load_scorer(args.checkpoint, rt, args.include_vocab_padding)
    res = lambada_eval(scorer, tok, texts, args.strict, args.batch_size, rt.dp, progress=progress_enabled(args.progress) and rt.is_main)
    res["data"] = args.data or f"{args.hf_dataset}[{args.hf_split}]"
    rows = [("mode", res["mode"]), ("accuracy", res["accuracy"]), ("correct / count", f"{res['correct']} / {res['count']}"),
            ("target-word perplexity", res["perplexity"]), ("tokens/s", res["tokens_per_second"])]
    _finish(args, rt, "LAMBADA" + _limited(args, "examples"), rows, res)


def run_race(args) -> None:
    from evaluation.model import setup_runtime
    from evaluation.race import race_accuracy
    questions, report = read_race_split(args.data, args.split)
    if not questions:
        raise EvalError(f"no valid RACE questions under {args.data}/{args.split} ({report.skipped} skipped)")
    questions = questions[:args.limit] if args.limit else questions  # read order: middle, high; files sorted
    rt = setup_runtime(args.tp, args.device)
    from evaluation.race_model import load_multiple_choice

    score_fn, tok = load_multiple_choice(args.checkpoint, rt)
    from training.checkpoint_reader import read_client_state

    model_cfg = read_client_state(args.checkpoint)["config"]["model"]
    positions = model_cfg.get("max_position_embeddings") or model_cfg["seq_length"]
    seq_length = args.seq_length or model_cfg["seq_length"]
    if seq_length > positions:
        raise EvalError(f"--seq-length {seq_length} exceeds the model's {positions} positions")
    samples = encode_questions(questions, tok, seq_length)
    res = race_accuracy(samples, score_fn, args.batch_size, progress=progress_enabled(args.progress) and rt.is_main)
    res.update(split=args.split, skipped=report.skipped, problems=report.problems, files=report.files)
    rows = [("middle accuracy", res.get("middle/accuracy", float("nan"))),
            ("high accuracy", res.get("high/accuracy", float("nan"))),
            ("all accuracy", res["accuracy"]), ("questions", res["count"]), ("skipped", report.skipped)]
    _finish(args, rt, f"RACE {args.split}" + _limited(args, "questions"), rows, res)


def run_generate(args) -> None:
    from evaluation.generate import GenerationOptions, generate, load_generator, read_prompts, utf8_prompts
    from evaluation.model import setup_runtime

    prompts = utf8_prompts(args.prompt) if args.prompt else read_prompts(args.prompts)
    opts = GenerationOptions(max_new_tokens=args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_at_eod=not args.no_stop_at_eod,
                             batch_size=args.batch_size)
    opts.check()  # before the model is loaded
    rt = setup_runtime(args.tp, args.device)
    if rt.pstate is not None and rt.pstate.dims.dp > 1:
        raise EvalError(f"generate runs one tensor-parallel replica: launch exactly --tp {args.tp} processes")
    model, tok = load_generator(args.checkpoint, rt.pstate.tp_group if rt.pstate is not None else None, str(rt.device))
    out = generate(model, tok, prompts, opts, progress=progress_enabled(args.progress) and rt.is_main)
    if not rt.is_main:
        return
    for p, c in zip(prompts, out):
        print(f"=== prompt: {p!r}\n{p}{c.text}" + ("" if c.stopped_at_eod else "  [max new tokens]"))
    result = {"task": "generate", "checkpoint": str(args.checkpoint), "options": opts.__dict__,
              "completions": [{"prompt": p, "text": c.text, "tokens": c.tokens, "stopped_at_eod": c.stopped_at_eod}
                              for p, c in zip(prompts, out)]}
    dest = output_path(args)
    atomic.write_json(dest, result)
    print(f"wrote {dest}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    # under the launcher every rank reads the same arguments and files and meets the same error: rank 0 says it
    say = int(os.environ.get("RANK", "0")) == 0
    try:
        if args.batch_size < 1:
            raise EvalError("--batch-size must be >= 1")
        if getattr(args, "limit", None) is not None and args.limit < 1:
            raise EvalError(f"--limit must be >= 1 (the number of leading items to score), got {args.limit}")
        if say:  # the file written at the end, checked before any model is loaded (rank 0 writes it)
            check_output_path(output_path(args), "--json" if args.json else "the result file")
        {"wikitext103": run_wikitext, "lambada": run_lambada, "race": run_race,
         "generate": run_generate, "heldout": heldout.run_heldout, "lm-eval": lm_eval_run.run_lm_eval}[args.task](args)
    except SuiteError as e:  # bad input from any stage (EvalError, ConfigError, TokenizerError ...): one line
        if say:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: results are written only when a task completes; rerun the same command", file=sys.stderr)
        return 130
    finally:  # the process groups setup_runtime started, torn down on every path (else an abort at exit)
        shutdown()
    return 0
