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
#
# It runs, each on 8 ranks with TORCHDYNAMO_DISABLE=1 (Megatron compiles dispatch_preprocess):
#   1. TestFlexDispatcher -k deepep through the plug-in (install(DispatchConfig(backend="torch")))
#   2. the same with a combine that halves its sum (must fail: the negative control)
#   3. test_a2a_token_dispatcher.py with Megatron's own all-to-all dispatcher (the harness works)
#   4. test_a2a_token_dispatcher.py with its dispatcher routed to the plug-in
# Shims (in mlm_cpu_plugin.py beside this file, nothing in Megatron edited): a gloo group created
# before the tests, .cuda() / synchronize / empty_cache as no-ops, the four CUDA shims of Megatron's
# all-to-all path, the "CUDA not available" and "Deep EP and Hybrid EP" skips dropped; the unit
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

run() {  # name, MLM_VIA, MLM_BREAK, test selection...
  local name=$1 via=$2 broken=$3
  shift 3
  echo "== $name" >&2
  (cd "$work" && PYTHONPATH="$work:$here:$root" TORCHDYNAMO_DISABLE=1 OMP_NUM_THREADS=1 \
    MLM_VIA=$via MLM_BREAK=$broken nice -n 15 "$venv/bin/python" -m torch.distributed.run \
    --standalone --nproc-per-node 8 -m pytest -p mlm_cpu_plugin -p no:cacheprovider -q -rA "$@" \
    > "$work/$name.log" 2>&1) || true
  grep -E "^[0-9]+ (passed|failed)|^(PASSED|FAILED)|dispatch calls" "$work/$name.log" | sort | uniq -c
}
flex=tests/unit_tests/transformer/moe/test_token_dispatcher.py::TestFlexDispatcher
a2a=tests/unit_tests/transformer/moe/test_a2a_token_dispatcher.py
run flex-deepep flex 0 "$flex" -k deepep
run flex-deepep-broken-combine flex 1 "$flex" -k deepep
run a2a-megatron none 0 "$a2a"
run a2a-via-flexdispatch a2a-flex 0 "$a2a"
echo "logs: $work" >&2
