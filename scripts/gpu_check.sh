#!/usr/bin/env bash
# Everything GPU-relevant about flexdispatch in one go, within 6 minutes on one GPU, with what the
# machine has (its torch, no registry): writes OUT/summary.md and one log per step in OUT.
#
#   scripts/gpu_check.sh OUT [--wheels DIR] [--jobs N] [--dry-run]
#
#   OUT           folder for summary.md and the logs (created)
#   --wheels DIR  first install the wheels in DIR with `pip install --no-index --no-deps` (e.g. the
#                 sgl-deep-ep wheels the DeepEP emulator tests load); nothing else is installed
#   --jobs N      pytest-xdist workers for the suites (default: CPU cores - 1, at most 15)
#   --dry-run     print the plan (steps, time limits, commands, skips and why) and exit
#   FLEXDISPATCH_PYTHON  interpreter (default: .venv/bin/python, else python3)
#
# Steps, each under its own time limit and all under one 360 s budget (a step that would start
# past it is skipped, saying so):
#   cuda        CUDA is there (device, torch, NCCL, transformers); without it the rest is skipped
#   wheels      --wheels only
#   gpu_tests   tests/gpu: the worst-case step captured in a CUDA graph, the host-sync detector on
#               every no-sync claim (tests/gpu/test_no_host_sync.py), the demo and the launch
#               recipe on the GPUs (tests/gpu/test_demo_gpu.py), DeepEP on >= 2 GPUs
#   unit_cuda   tests/unit with FLEXDISPATCH_TEST_DEVICE=cuda (the core tests on the GPU)
#   suite       the whole suite with CUDA visible (tests/gpu aside: run above), pytest -n N
#   bench       benchmarks/bench_gpu.py --quick (routing, permute, dispatch), if it exists
# The DeepEP emulator tests need the sgl-deep-ep and sgl-deep-ep-v25 wheels' files: without them
# the multi-process ones are left out of the suite (--ignore) and the summary says so; the unit
# ones skip themselves with the reason. Likewise the plug-in tests (tests/dist/test_megatron*.py,
# test_torchtitan.py) need megatron-core and torchtitan (scripts/setup.sh installs them where a
# registry is reachable; --wheels can carry them): without them they are left out, saying so.
# Exit status: 0 all ran steps passed (or skipped, with the reason), 1 a step failed, 2 bad usage.
set -uo pipefail

usage() {
    echo "usage: scripts/gpu_check.sh OUT [--wheels DIR] [--jobs N] [--dry-run]" >&2
    [[ -n ${1:-} ]] && echo "gpu_check: $1" >&2
    exit 2
}

out="" wheels="" jobs="" dry=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --wheels)
            [[ $# -ge 2 && $2 != -* ]] || usage "--wheels needs a folder"
            wheels=$2; shift 2 ;;
        --jobs)
            [[ $# -ge 2 && $2 != -* ]] || usage "--jobs needs a number"
            jobs=$2; shift 2 ;;
        --dry-run) dry=1; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) usage "unknown option $1" ;;
        *)
            [[ -z $out ]] || usage "one OUT folder only (got '$out' and '$1')"
            out=$1; shift ;;
    esac
done
[[ -n $out ]] || usage "OUT (the folder for summary.md and the logs) is required"
[[ -e $out && ! -d $out ]] && usage "OUT '$out' exists and is not a folder"
if [[ -n $jobs && ! $jobs =~ ^[1-9][0-9]*$ ]]; then
    usage "--jobs must be a positive integer, got '$jobs'"
fi
if [[ -n $wheels ]]; then
    [[ -d $wheels ]] || usage "--wheels '$wheels' is not a folder"
    compgen -G "$wheels/*.whl" >/dev/null || usage "--wheels '$wheels' holds no .whl file"
fi

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${FLEXDISPATCH_PYTHON:-$root/.venv/bin/python}
[[ -x $py ]] || py=$(command -v python3 || true)
[[ -n $py ]] || usage "no python found (set FLEXDISPATCH_PYTHON)"
cd "$root" || exit 2
if [[ -z $jobs ]]; then
    cores=$(nproc 2>/dev/null || echo 2)
    jobs=$(( cores > 16 ? 15 : (cores > 1 ? cores - 1 : 1) ))
fi

BUDGET=360
has() { "$py" -c "import $1" >/dev/null 2>&1; }
# pytest plugins the machine may lack: then the suites run serially / without per-test timeouts.
xdist=() timeout_opt=() notes=()
if has xdist; then xdist=(-n "$jobs"); else notes+=("pytest-xdist absent: suites run serially"); fi
if has pytest_timeout; then
    timeout_opt=(--timeout 120)
else
    notes+=("pytest-timeout absent: no per-test timeout (step limits still apply)")
fi
# The DeepEP emulator tests load the sgl-deep-ep wheels' Python files.
emu_missing=$("$py" - <<'EOF' 2>/dev/null
import importlib.metadata as m
miss = []
for name in ("sgl-deep-ep", "sgl-deep-ep-v25"):
    try:
        m.distribution(name)
    except m.PackageNotFoundError:
        miss.append(name)
print(" ".join(miss))
EOF
)
ignore=()
if [[ -n $wheels ]]; then
    emu_missing=""  # decided after the wheels step
fi
emu_ignores() {
    ignore=() emu_count=0
    [[ -z $emu_missing ]] && return
    local f
    while IFS= read -r f; do
        ignore+=("--ignore=$f")
    done < <(grep -rlE --include='test_*.py' 'load_deep_ep|load_v25' tests/dist tests/hardening \
             | sort)
    emu_count=${#ignore[@]}
}
emu_ignores

# The plug-in tests import Megatron-Core / torchtitan (and spmd_types) in their ranks.
integ_missing=""
integ_ignores() {
    integ_missing=$("$py" -c '
import importlib.util as u
print(" ".join(m for m in ("megatron", "torchtitan", "spmd_types") if u.find_spec(m) is None))
' 2>/dev/null) || integ_missing="megatron torchtitan spmd_types"
    [[ -z $integ_missing ]] && return
    local f
    while IFS= read -r f; do
        ignore+=("--ignore=$f")
    done < <(grep -rlE --include='test_*.py' 'megatron_host|torchtitan_host' tests/dist | sort)
}
[[ -z $wheels ]] && integ_ignores

# step NAME LIMIT CMD...: the plan (dry run) or the run; one summary row each.
rows=() failed=0 start=$SECONDS
step() {
    local name=$1 limit=$2
    shift 2
    if [[ $dry -eq 1 ]]; then
        local shown
        shown=$(printf '%q ' "$@")
        [[ "$*" == *$'\n'* ]] && shown="${shown:0:120}... (a python check)"
        printf '%-10s <= %3ss  %s\n' "$name" "$limit" "$shown"
        return 0
    fi
    local left=$(( BUDGET - (SECONDS - start) ))
    if [[ $left -lt 10 ]]; then
        rows+=("| $name | SKIP | 0 | no time left in the ${BUDGET} s budget |")
        return 0
    fi
    (( limit > left )) && limit=$left
    local log="$out/$name.log" rc=0 t0=$SECONDS verdict detail
    timeout -k 10 "$limit" "$@" >"$log" 2>&1 || rc=$?
    detail=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-200 | tr '|' '/')
    if [[ $rc -eq 0 ]]; then
        verdict=PASS
        if grep -qE '[0-9]+ skipped' "$log" && ! grep -qE '[0-9]+ passed' "$log"; then
            verdict=SKIP
        fi
    elif [[ $rc -eq 5 ]]; then
        verdict=SKIP detail="no tests collected: $detail"
    else
        verdict=FAIL failed=1
        [[ $rc -eq 124 || $rc -eq 137 ]] && detail="timed out after ${limit} s: $detail"
    fi
    rows+=("| $name | $verdict | $(( SECONDS - t0 )) | $detail (log: $name.log) |")
    echo "gpu_check: $name: $verdict ($(( SECONDS - t0 )) s) $detail"
    return $rc
}
skip() {
    if [[ $dry -eq 1 ]]; then
        printf '%-10s SKIP   %s\n' "$1" "$2"
    else
        rows+=("| $1 | SKIP | 0 | $2 |")
        echo "gpu_check: $1: SKIP $2"
    fi
}

PYTEST=("$py" -m pytest -q -rs -p no:cacheprovider)
run_steps() {
    step cuda 20 "$py" -c '
import torch
assert torch.cuda.is_available(), f"torch.cuda.is_available() is False (torch {torch.__version__})"
names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
try:
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
except Exception as exc:  # no NCCL in this build
    nccl = f"none ({type(exc).__name__})"
try:
    import transformers
    tf = transformers.__version__
except ImportError:
    tf = "absent"
print(f"{torch.cuda.device_count()} GPU(s): {names}; torch {torch.__version__}, NCCL {nccl}, "
      f"transformers {tf}")
'
    local cuda_rc=$?
    if [[ -n $wheels ]]; then
        step wheels 30 "$py" -m pip install --no-index --no-deps "$wheels"/*.whl
        if [[ $dry -eq 0 ]]; then
            emu_missing=$("$py" -c '
import importlib.metadata as m
miss = []
for n in ("sgl-deep-ep", "sgl-deep-ep-v25"):
    try:
        m.distribution(n)
    except m.PackageNotFoundError:
        miss.append(n)
print(" ".join(miss))' 2>/dev/null)
            emu_ignores
            integ_ignores
        fi
    fi
    if [[ $dry -eq 0 && $cuda_rc -ne 0 ]]; then
        for s in gpu_tests unit_cuda suite bench; do skip "$s" "no CUDA (see the cuda step)"; done
        return
    fi
    if [[ -n $emu_missing ]]; then
        local why="$emu_count DeepEP emulator test files left out: $emu_missing not installed"
        skip deepep_emu "$why (pass --wheels DIR with their wheels)"
    fi
    if [[ -n $integ_missing ]]; then
        skip integrations "plug-in test files left out: $integ_missing not importable (pass --wheels DIR with megatron-core, torchtitan and spmd_types wheels)"
    fi
    step gpu_tests 110 "${PYTEST[@]}" "${timeout_opt[@]}" tests/gpu
    step unit_cuda 50 env FLEXDISPATCH_TEST_DEVICE=cuda "${PYTEST[@]}" "${xdist[@]}" \
        "${timeout_opt[@]}" tests/unit
    step suite 130 "${PYTEST[@]}" "${xdist[@]}" "${timeout_opt[@]}" "${ignore[@]}" \
        --ignore=tests/gpu tests
    if [[ -f benchmarks/bench_gpu.py ]]; then
        step bench 50 "$py" benchmarks/bench_gpu.py --quick --sections routing,permute,dispatch \
            --json "$out/bench_gpu.json"
    else
        skip bench "benchmarks/bench_gpu.py is not in this checkout"
    fi
}

if [[ $dry -eq 1 ]]; then
    echo "gpu_check plan (python $py, --jobs $jobs, budget ${BUDGET} s, summary in $out/summary.md):"
    for n in "${notes[@]}"; do echo "note: $n"; done
    run_steps
    exit 0
fi

mkdir -p "$out" || usage "cannot create OUT '$out'"
run_steps
{
    echo "# flexdispatch gpu_check"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'),"
    echo "python $py, --jobs $jobs, $(( SECONDS - start )) s of a ${BUDGET} s budget."
    grep -v '^[[:space:]]*$' "$out/cuda.log" 2>/dev/null | tail -n 1 | sed 's/^/Machine: /'
    for n in "${notes[@]}"; do echo "Note: $n."; done
    echo
    echo "| step | verdict | seconds | detail |"
    echo "|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
} >"$out/summary.md"
echo "gpu_check: summary in $out/summary.md"
exit "$failed"
