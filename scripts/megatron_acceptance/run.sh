#!/usr/bin/env bash
# Megatron-LM's own dispatcher unit tests (tag core_v0.19.0) through flexdispatch's Megatron
# plug-in, on CPU over gloo, world 8. An acceptance run by hand (docs/integrations.md); CI never
# runs it (8 ranks of Megatron on a 2-core machine, a 4.8 GB environment).
#
#   bash scripts/megatron_acceptance/run.sh /path/to/Megatron-LM     # a git checkout with the tag
#
#   MLM_VENV   the Python 3.12 environment (default /tmp/flexdispatch-mlm-venv; the tests import
#              megatron.training, which needs 3.12; the only cp312 torch 2.13.0 wheel on the
#              index is the CUDA build, which runs on the CPU)
#   MLM_WORK   where the tests are extracted (default: a new temporary folder)
#   MLM_STEPS  which of the steps below to run (default 1,2,3,4; e.g. MLM_STEPS=1,2,4 skips the
#              slow self-check)
#
# It runs, each on 8 ranks with TORCHDYNAMO_DISABLE=1 (Megatron compiles dispatch_preprocess):
#   1. TestFlexDispatcher -k deepep through the plug-in (install(DispatchConfig(backend="torch")))
#   2. the same with a combine that halves its sum (must fail: the negative control)
#   3. test_a2a_token_dispatcher.py with Megatron's own all-to-all dispatcher (the harness works)
#   4. test_a2a_token_dispatcher.py with its dispatcher routed to the plug-in
# A step that is killed or fails is reported and the next one runs; the script exits 1 at the end
# when step 1 or 3 failed or step 2 (the negative control) passed. Step 4's 4 expected failures are
# the plug-in's refusal of moe_pad_expert_input_to_capacity (docs/integrations.md).
# Shims (in mlm_cpu_plugin.py beside this file, nothing in Megatron edited): a gloo group created
# before the tests, .cuda() / synchronize / empty_cache as no-ops, the four CUDA shims of Megatron's
# all-to-all path, the "CUDA not available" and "Deep EP and Hybrid EP" skips dropped, every
# process group of Megatron's model-parallel state destroyed with it (each test re-creates them:
# its gloo groups and their threads piled up, ~900 threads per rank by step 3); the unit
# tests' conftest.py without its data-set download fixture and dist_checkpointing/__init__.py as a
# one-line stub (copies in MLM_WORK, the checkout is not touched).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
mlm=${1:?usage: run.sh /path/to/Megatron-LM (a git checkout holding tag core_v0.19.0)}
venv=${MLM_VENV:-/tmp/flexdispatch-mlm-venv}
work=${MLM_WORK:-$(mktemp -d)}
py312=${PYTHON312:-python3.12}

if [ ! -x "$venv/bin/python" ]; then
  "$py312" -m venv "$venv"
  "$venv/bin/python" -m pip install -q torch==2.13.0 megatron-core==0.19.2 pytest pydantic pyyaml
fi
git -C "$mlm" archive core_v0.19.0 tests/__init__.py tests/unit_tests/__init__.py \
  tests/unit_tests/test_utilities.py tests/unit_tests/conftest.py tests/unit_tests/transformer \
  tests/unit_tests/dist_checkpointing/__init__.py | tar -x -C "$work"
"$venv/bin/python" - "$work" <<'PY'
import pathlib, sys
unit = pathlib.Path(sys.argv[1]) / "tests" / "unit_tests"
conftest = unit / "conftest.py"
text = conftest.read_text()
text = text.replace(
    "from tests.test_utils.python_scripts.download_unit_tests_dataset import "
    "download_and_extract_asset\n", ""
)
start = text.index('@pytest.fixture(scope="session", autouse=True)\ndef ensure_test_data():')
end = text.index("@pytest.fixture(autouse=True)\ndef reset_env_vars():")
conftest.write_text(text[:start] + text[end:])
(unit / "dist_checkpointing" / "__init__.py").write_text(
    "from tempfile import TemporaryDirectory as TempNamedDir  # noqa: F401\n"
)
PY

steps=",${MLM_STEPS:-1,2,3,4},"
failed=()
run() {  # step, name, MLM_VIA, MLM_BREAK, expect (pass / fail / report), test selection...
  local step=$1 name=$2 via=$3 broken=$4 expect=$5 rc=0
  shift 5
  if [[ "$steps" != *",$step,"* ]]; then
    echo "== $name: skipped (MLM_STEPS=${MLM_STEPS:-})" >&2
    return 0
  fi
  echo "== $name" >&2
  (cd "$work" && PYTHONPATH="$work:$here:$root" TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 \
    MLM_VIA=$via MLM_BREAK=$broken nice -n 15 "$venv/bin/python" -m torch.distributed.run \
    --standalone --nproc-per-node 8 -m pytest -p mlm_cpu_plugin -p no:cacheprovider -q -rA "$@" \
    > "$work/$name.log" 2>&1) || rc=$?
  # NOTE: a killed step leaves no summary: say so, and go on with the next step
  { grep -E "^[0-9]+ (passed|failed)|^(PASSED|FAILED)|dispatch calls|threads" "$work/$name.log" \
    || echo "no summary: the step was killed or failed before pytest reported, see $work/$name.log"
  } | sort | uniq -c
  echo "== $name: exit code $rc (expected: $expect)" >&2
  if [[ "$expect" == pass && $rc -ne 0 ]] || [[ "$expect" == fail && $rc -eq 0 ]]; then
    failed+=("$name")
  fi
}
flex=tests/unit_tests/transformer/moe/test_token_dispatcher.py::TestFlexDispatcher
a2a=tests/unit_tests/transformer/moe/test_a2a_token_dispatcher.py
run 1 flex-deepep flex 0 pass "$flex" -k deepep
run 2 flex-deepep-broken-combine flex 1 fail "$flex" -k deepep
run 3 a2a-megatron none 0 pass "$a2a"
run 4 a2a-via-flexdispatch a2a-flex 0 report "$a2a"
echo "logs: $work" >&2
if (( ${#failed[@]} )); then
  echo "not as expected: ${failed[*]}" >&2
  exit 1
fi
