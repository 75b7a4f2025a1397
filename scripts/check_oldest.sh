#!/usr/bin/env bash
# Tests pyproject.toml's lower bounds: installs the project into a throwaway venv with every runtime
# dependency pinned to the oldest version its bound allows (scripts/oldest_constraints.py; torch stays at
# the tested version), then runs the tests that exercise those packages.
#   bash scripts/check_oldest.sh [pytest args]      # OLDEST_VENV=/tmp/oldest-venv by default
# Not run by CI: it downloads and installs a second full environment (a few hundred MB of old wheels,
# some built from source) and takes 5-20 minutes on 2 cores, for bounds that change rarely. Run it when
# a bound in pyproject.toml moves; docs/dependencies.md lists the bounds and what this found.
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST_VENV=${OLDEST_VENV:-/tmp/oldest-venv}
PY=${PYTHON:-python3}

# throwaway: an earlier venv there is replaced; anything else there is refused, never deleted
if [ -e "$OLDEST_VENV" ]; then
  [ -f "$OLDEST_VENV/pyvenv.cfg" ] || { echo "check_oldest: $OLDEST_VENV exists and is not a venv; set OLDEST_VENV" >&2; exit 2; }
  rm -rf "$OLDEST_VENV"
fi
"$PY" -m venv "$OLDEST_VENV"
"$PY" scripts/oldest_constraints.py > "$OLDEST_VENV/oldest-constraints.txt"
echo "check_oldest: pins ($OLDEST_VENV/oldest-constraints.txt):"
grep -v '^#' "$OLDEST_VENV/oldest-constraints.txt" | paste -sd' ' -

# The set-up itself, unchanged (torch from the source scripts/torch_source.py picks for this machine,
# DeepSpeed as its docs recommend, then the project, runtime only), with every pip call of it under the
# oldest pins: PIP_CONSTRAINT is pip's --constraint. It replaces pip's configured constraint files, so
# those (e.g. a machine-wide cap on torch) are passed on too.
machine_constraints=$("$PY" -m pip config list 2>/dev/null | sed -n "s/^global\.constraint='\(.*\)'$/\1/p" | head -n1)
export PIP_CONSTRAINT="$OLDEST_VENV/oldest-constraints.txt${machine_constraints:+ $machine_constraints}"
deepspeed_oldest=$(sed -n 's/^deepspeed==//p' "$OLDEST_VENV/oldest-constraints.txt")
VENV="$OLDEST_VENV" DEEPSPEED_VERSION="$deepspeed_oldest" bash scripts/setup_env.sh --no-constraints
"$OLDEST_VENV/bin/python" -m pip install -q --disable-pip-version-check "pytest>=7" "pytest-timeout>=2" regex  # regex: the tests' reference GPT-2 BPE port
"$OLDEST_VENV/bin/python" -m pip list --disable-pip-version-check > "$OLDEST_VENV/installed.txt"
echo "check_oldest: installed (pins above honoured; the rest resolved by pip) -> $OLDEST_VENV/installed.txt"

# The tests of the code that uses the pinned packages: corpus building (datasketch, ftfy, xxhash, pyarrow,
# datasets, tqdm, numpy), tokenizers (tokenizers, sentencepiece), the indexed dataset and GPT
# sampling (numpy), Hugging Face dataset loading (datasets), WikiText/LAMBADA/RACE scoring through the
# local `evaluate` metrics, a single-process DeepSpeed fp16 training run and the start-up config errors
# (deepspeed, pyyaml, sentencepiece).
# The hf/eval/tracking extras are not installed: the tests that import transformers are deselected (and
# safetensors and matplotlib, used only through transformers' export and the main job's report, are
# installed but not exercised; docs/dependencies.md).
TESTS=(tests/unit/test_data_*.py tests/e2e/test_data_*.py tests/unit/test_tokenizer.py tests/unit/test_indexed_dataset.py tests/unit/test_gpt_dataset.py
       tests/e2e/test_hf_dataset_scripts.py tests/unit/test_blending.py
       tests/unit/test_eval_wikitext.py tests/unit/test_eval_lambada.py tests/unit/test_eval_race.py
       tests/e2e/test_training.py::test_fp16_overflow_skips_step_halves_scale_and_aborts
       tests/e2e/test_training.py::test_bad_config_fails_with_one_clear_line)
DESELECT=(--deselect tests/unit/test_tokenizer.py::test_gpt2_matches_transformers_on_real_text
          --deselect tests/unit/test_tokenizer.py::test_gpt2_eod_and_special_string)
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec "$OLDEST_VENV/bin/python" -m pytest -q -ra -p no:cacheprovider "${DESELECT[@]}" "${TESTS[@]}" "$@"
