"""``python -m evaluation lm-eval``: lm-evaluation-harness's own tasks and metrics on a training run directory.

    python -m evaluation lm-eval --checkpoint RUN --tasks lambada_openai,hellaswag [--num-fewshot K] [--limit N]
    deepspeed --num_gpus 2 --module evaluation lm-eval --tp 2 --checkpoint RUN --tasks ...

The model is :class:`evaluation.lm_eval_model.SuiteLM` (our TP-aware scorer; no export needed). Tasks are
lm-eval's, fetched by lm-eval from the Hugging Face hub as usual. Offline, two local tasks are derived from
lm-eval's own installed task files with only the dataset source swapped to a local file (nothing hand-edited):

* ``--lambada FILE`` adds ``lambada_openai_local`` (lm-eval's ``lambada_openai.yaml``) over a
  ``lambada_test.jsonl`` (``{"text": ...}`` per line, the file lm-eval's hub dataset holds);
* ``--wikitext FILE`` adds ``wikitext_local`` (lm-eval's ``wikitext.yaml``: rolling log-likelihood, word and
  byte perplexity, its own detokenizer) over a WikiText ``.tokens``/``.raw`` file cut into articles at the
  ``" = Title = "`` lines, as the ``EleutherAI/wikitext_document_level`` dataset is.

Results: lm-eval's table on stdout and its result dictionary in ``RUN/eval/lm_eval.json`` (or ``--json``).
"""
from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

from evaluation.errors import EvalError
from megatron_ds_suite.core import atomic
from megatron_ds_suite.core.network import hub_offline, network_reachable
from megatron_ds_suite.core.textfile import read_utf8

HEADING = re.compile(r"^ = [^=].* = $")
"""A WikiText article title line (one '=' on each side; sections have two or more)."""


def add_parser(sub) -> None:
    """The ``lm-eval`` subcommand of ``python -m evaluation``."""
    ap = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks on a checkpoint (any TP; no export)",
                        description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="run directory written by training")
    ap.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    ap.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    ap.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N documents of each task")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    ap.add_argument("--max-gen-toks", type=int, default=256, help="generation tasks: new tokens at most")
    ap.add_argument("--lambada", default=None, metavar="FILE", help="local lambada_test.jsonl: adds lambada_openai_local")
    ap.add_argument("--wikitext", default=None, metavar="FILE", help="local WikiText .tokens/.raw: adds wikitext_local")
    ap.add_argument("--include-path", default=None, help="extra folder of lm-eval task YAML files")
    ap.add_argument("--seed", type=int, default=1234, help="lm-eval's seeds (few-shot sampling, python, numpy, torch)")
    ap.add_argument("--json", default=None, help="output JSON (default RUN_DIR/eval/lm_eval.json)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (launch exactly this many processes)")
    ap.add_argument("--device", default=None, help="torch device (default: cuda:LOCAL_RANK if available, else cpu)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="accepted for symmetry with the other tasks (lm-eval draws its own bars)")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)


def wikitext_pages(text: str) -> list[str]:
    """A WikiText file cut into articles: each starts at a title line (``" = Title = "``), blank lines kept."""
    pages: list[list[str]] = []
    for line in text.splitlines(keepends=True):
        if HEADING.match(line.rstrip("\n")) or not pages:
            pages.append([])
        pages[-1].append(line)
    return ["".join(p) for p in pages if "".join(p).strip()]


OPTIONS = ("--lambada", "--wikitext")
"""How the local tasks' files are named to the user in messages (the command's options; training: ``eval.*``)."""


def local_tasks(folder: Path, lambada: str | None, wikitext: str | None, options: tuple[str, str] = OPTIONS) -> list[str]:
    """Write the local task files (and the WikiText pages as JSON lines) into ``folder``; returns their names."""
    import lm_eval.tasks

    installed = Path(lm_eval.tasks.__file__).parent
    names = []
    if lambada:
        if not Path(lambada).is_file():
            raise EvalError(f"{options[0]} {lambada} does not exist (give lambada_test.jsonl)")
        from evaluation.lambada import read_lambada_jsonl

        read_lambada_jsonl(lambada)  # every line a {"text": ...} object: else one line now, not a traceback mid-run
        _write_task(folder, "lambada_openai_local", installed / "lambada" / "lambada_openai.yaml", Path(lambada).resolve())
        names.append("lambada_openai_local")
    if wikitext:
        src = Path(wikitext)
        if not src.is_file():
            raise EvalError(f"{options[1]} {wikitext} does not exist (give a WikiText .tokens or .raw file)")
        pages = wikitext_pages(read_utf8(src, options[1], EvalError))
        if not pages:
            raise EvalError(f"{options[1]} {wikitext} holds no text")
        data = folder / "wikitext_pages.jsonl"
        data.write_text("".join(json.dumps({"page": p}) + "\n" for p in pages), encoding="utf-8")
        _write_task(folder, "wikitext_local", installed / "wikitext" / "wikitext.yaml", data)
        names.append("wikitext_local")
    return names


def _write_task(folder: Path, name: str, base: Path, data: Path) -> None:
    """A task file that includes lm-eval's own ``base`` and swaps only its dataset (and name) for ``data``."""
    if not base.is_file():
        raise EvalError(f"the installed lm-eval has no {base.name} to derive {name} from: check the lm-eval version")
    lines = [f"include: {json.dumps(str(base))}", f"task: {name}", "tag: []", "dataset_path: json", "dataset_name: null",
             "dataset_kwargs:", "  data_files:", f"    test: {json.dumps(str(data))}",
             "training_split: null", "validation_split: null", "test_split: test"]
    (folder / f"{name}.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")


LOCAL_LOADERS = {"json", "csv", "text", "parquet", "arrow", "pandas", "imagefolder", "audiofolder"}
"""``dataset_path`` values of lm-eval task files that read local files (``datasets``' packaged loaders)."""


def hub_datasets(manager, tasks: list[str]) -> dict[str, str]:
    """``{task: hub dataset}`` for the requested tasks (groups and tags expanded) whose data lm-eval fetches from
    the Hugging Face hub; a task whose file does not say is left out (lm-eval decides when it runs)."""
    index = getattr(manager, "task_index", {})
    found: dict[str, str] = {}
    seen: set[str] = set()
    todo = list(tasks)
    while todo:
        name = todo.pop()
        entry = index.get(name) if isinstance(name, str) else None
        if name in seen or entry is None:
            continue
        seen.add(name)
        cfg = getattr(entry, "cfg", None) or {}
        children = cfg.get("task") if isinstance(cfg.get("task"), list) else []
        if getattr(entry, "yaml_path", None) is None or children:  # a tag or a group: its tasks
            todo += [c for c in children if isinstance(c, str)] + sorted(getattr(entry, "tags", None) or ())
            continue
        path = cfg.get("dataset_path")
        if isinstance(path, str) and path not in LOCAL_LOADERS and not Path(path).exists():
            found[name] = path
    return found


def check_hub_reachable(installed: list[str], remote: dict[str, str], timeout: float = 3.0,
                        options: tuple[str, str] = OPTIONS) -> None:
    """Refuse, before lm-eval indexes its tasks and the model is loaded, tasks that read their data from the
    Hugging Face hub when the machine is offline (``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` set, or huggingface.co
    not answering within ``timeout`` s): ``installed`` are lm-eval's own tasks (they read the hub), ``remote`` the
    local task files' tasks whose ``dataset_path`` is a hub name. ``datasets`` would otherwise retry and end in a
    traceback after the model was loaded."""
    if not (installed or remote) or network_reachable(timeout=timeout):
        return
    why = "HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set" if hub_offline() else f"huggingface.co did not answer in {timeout:g} s"
    named = ", ".join(installed + [f"{t} ({d})" for t, d in sorted(remote.items())])
    raise EvalError(f"task(s) {named} read their data from the Hugging Face hub, which is unreachable ({why}): "
                    f"run them with network access, or use the local tasks ({options[0]} FILE: lambada_openai_local, "
                    f"{options[1]} FILE: wikitext_local)")


def task_manager(folder: Path, tasks: list[str], lambada: str | None, wikitext: str | None,
                 include_path: str | None = None, options: tuple[str, str] = OPTIONS):
    """lm-eval's ``TaskManager`` for ``tasks``, the local tasks (``lambada``, ``wikitext``) written into ``folder``,
    which must outlive it. Refuses, in one line and before any model is loaded, a task lm-eval does not know and,
    offline, a task whose data is on the Hugging Face hub."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise EvalError(f"lm-eval is not installed ({e}): pip install 'megatron-ds-suite[eval]'") from e
    if include_path and not Path(include_path).is_dir():
        raise EvalError(f"--include-path {include_path} is not a folder (of lm-eval task YAML files)")
    local = local_tasks(folder, lambada, wikitext, options)
    include = [str(folder)] + ([include_path] if include_path else [])
    # the local task files alone first (indexing lm-eval's ~14,000 installed task files takes ~20 s): offline,
    # a task that is not among them is refused before that, in one line
    manager = TaskManager(include_path=include, include_defaults=False)
    installed = [t for t in tasks if t not in manager.all_tasks]
    check_hub_reachable(installed, hub_datasets(manager, [t for t in tasks if t not in installed]), options=options)
    if installed:
        manager = TaskManager(include_path=include)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        hint = f" (local tasks here: {', '.join(local)})" if local else f" ({'/'.join(options)} add local ones)"
        raise EvalError(f"lm-eval knows no task {', '.join(unknown)}{hint}")
    return manager


def evaluate_tasks(lm, manager, tasks: list[str], num_fewshot: int | None, limit: int | None, seed: int = 1234):
    """lm-eval's ``simple_evaluate`` of ``lm`` on ``tasks``, every seed lm-eval takes set to ``seed`` (the few-shot
    examples and any sampling are the same at every call); lm-eval's result dictionary (None off the main rank)."""
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                           bootstrap_iters=0, log_samples=False, random_seed=seed, numpy_random_seed=seed,
                           torch_random_seed=seed, fewshot_random_seed=seed, verbosity="ERROR")


def run_lm_eval(args: argparse.Namespace) -> None:
    """Run the tasks; bad input raises :class:`EvalError` (one line, exit code 2 in the CLI)."""
    if args.batch_size < 1 or args.max_gen_toks < 1:
        raise EvalError("--batch-size and --max-gen-toks must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit must be >= 1, got {args.limit}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise EvalError("--tasks names no task (comma-separated lm-eval task names)")
    try:
        from lm_eval.utils import make_table
    except ImportError as e:
        raise EvalError(f"lm-eval is not installed ({e}): pip install 'megatron-ds-suite[eval]'") from e
    from evaluation.lm_eval_model import SuiteLM
    from evaluation.model import setup_runtime

    with tempfile.TemporaryDirectory(prefix="lm_eval_tasks_") as tmp:
        manager = task_manager(Path(tmp), tasks, args.lambada, args.wikitext, args.include_path)
        rt = setup_runtime(args.tp, args.device)
        if rt.pstate is not None and rt.pstate.dims.dp > 1:
            raise EvalError(f"lm-eval runs one tensor-parallel replica: launch exactly --tp {args.tp} processes")
        lm = SuiteLM.from_checkpoint(args.checkpoint, rt, batch_size=args.batch_size, max_gen_toks=args.max_gen_toks)
        res = evaluate_tasks(lm, manager, tasks, args.num_fewshot, args.limit, args.seed)
    if not rt.is_main or res is None:
        return
    out = Path(args.json) if args.json else Path(args.checkpoint) / "eval" / "lm_eval.json"  # checked before scoring
    keep = {k: res[k] for k in ("results", "versions", "n-shot", "higher_is_better", "n-samples") if k in res}
    atomic.write_json(out, {"task": "lm-eval", "checkpoint": str(args.checkpoint), "tp": args.tp, "limit": args.limit,
                            "tasks": tasks, **keep})
    print(make_table(res))
    print(f"wrote {out}")
