"""Hostile-user probe (issue 30): run the real commands on damaged or wrong inputs and classify what the user sees.

    python -m tests.hostile [--root CHECKOUT] [--only PATTERN] [--jobs N] [--json OUT.json] [--md OUT.md]
    python -m tests.hostile --compare before=BEFORE.json after=AFTER.json [--md OUT.md]

Each case sets itself up in a temporary folder (tiny corpora built by the project's own builder, a two-step TP=1
GPT-2 run, a random transformers GPT-2 imported at TP=2, then damaged copies of them: truncated shards, swapped
tokenizer files, a binary ``latest``, out-of-range token ids, nested JSON lines, a live run held by its lock, ...),
runs one command of the checkout under test (``--root``, default this one) in a subprocess with a timeout, and
classifies the outcome:

- **clean**: where the input is wrong, a non-zero exit with an error line and no traceback; where the right
  answer is to go on (a counted reject, a warning and a rebuild), exit 0 and the documented effect;
- **traceback**: a Python traceback reaches the user (any rank);
- **silent**: exit 0 where the input was wrong, the documented effect missing (e.g. ``skipped 0``), or damage done
  whatever the exit code (a live run modified, a file written outside the output folder, an edited file replaced);
- **hang**: the command ran past its timeout (killed with its process group).

The fixtures are built once per run by the checkout under test (so a checkout before a format change probes its
own files); ``--root`` lets one probe file measure an older checkout (``git worktree add``). Not part of the test
suite (pytest collects none of its modules): it takes about 40 minutes (docs/errors.md has the command and the last
counts).

The package: :mod:`~tests.hostile.cli` (choosing and running the cases, the reports), :mod:`~tests.hostile.probe`
(running one command), :mod:`~tests.hostile.fixtures` (what the cases copy), :mod:`~tests.hostile.case` (the case
helper and the registry), :mod:`~tests.hostile.commands` and :mod:`~tests.hostile.damage` (what the cases of several
families share), :mod:`~tests.hostile.outcome` (classification and reports), and :mod:`tests.hostile.cases`, one
module per family.
"""
