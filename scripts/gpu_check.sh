#!/usr/bin/env bash
# One short GPU check of flexdispatch (under 5 minutes on one GPU). Prints one summary line per
# check ("gpu_check: <name>: PASS|FAIL|SKIP <detail>") and exits 1 if any check failed.
#
#   scripts/gpu_check.sh            # uses .venv/bin/python, else python3
#   FLEXDISPATCH_PYTHON=/usr/bin/python3 scripts/gpu_check.sh
#
# Checks: CUDA is there; the unit tests (with FLEXDISPATCH_TEST_DEVICE=cuda); the torch backend's
# worst-case step captured in a CUDA graph and replayed equal to eager; no host sync
# (torch.cuda.set_sync_debug_mode("error")) in worst-case dispatch/combine, routing, layout,
# static permute and the deepep masking helpers;
# the DeepEP GPU tests, V1 and V2 (ElasticBuffer: contract, MoELayer, CUDA-graph capture/replay;
# skipped with the reason unless deep_ep imports, has ElasticBuffer, and >= 2 GPUs); routing and
# permute throughput as a fraction of a device copy of the same bytes.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${FLEXDISPATCH_PYTHON:-$root/.venv/bin/python}
if [[ ! -x $py ]]; then
    py=$(command -v python3 || true)
fi
if [[ -z $py ]]; then
    echo "gpu_check: no python found (set FLEXDISPATCH_PYTHON)" >&2
    exit 1
fi
cd "$root" || exit 1
logs=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
failed=0

# run NAME SECONDS CMD...: run CMD with a deadline; its last output line is the detail.
run() {
    local name=$1 limit=$2
    shift 2
    local log="$logs/$name.log" rc=0 verdict detail
    timeout "$limit" "$@" >"$log" 2>&1 || rc=$?
    detail=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-160)
    if [[ $rc -eq 0 ]]; then
        verdict=PASS
        if grep -qE '^SKIP|[0-9]+ skipped' "$log" && ! grep -qE '[0-9]+ passed' "$log"; then
            verdict=SKIP
        fi
    else
        verdict=FAIL
        failed=1
        [[ $rc -eq 124 ]] && detail="timed out after ${limit}s"
        detail="$detail (log: $log)"
    fi
    echo "gpu_check: $name: $verdict $detail"
}

run cuda 60 "$py" -c '
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
'
# The core reference tests (routing, permute, layout, experts) take the `device` fixture
# (tests/conftest.py): here they run on CUDA; the rest of tests/unit runs as on the CPU.
run unit_tests 150 env FLEXDISPATCH_TEST_DEVICE=cuda "$py" -m pytest tests/unit -q -x \
    -p no:cacheprovider
run graph_capture 120 "$py" -m pytest tests/gpu/test_torch_cuda.py -q -p no:cacheprovider \
    -k graph
run sync_debug_dispatch 120 "$py" -m pytest tests/gpu/test_torch_cuda.py -q \
    -p no:cacheprovider -k sync
run sync_debug_ops 90 "$py" - <<'EOF'
import torch

from flexdispatch import get_dispatch_layout, permute, topk_routing, unpermute
from flexdispatch.backends.deepep import sizing as S
from flexdispatch.decode import expert_major_maps, from_expert_major, to_expert_major

dev = torch.device("cuda")
T, H, E, k, R = 4096, 1024, 64, 8, 8
logits = torch.randn(T, E, device=dev)
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
torch.cuda.synchronize()
names = []
torch.cuda.set_sync_debug_mode("error")
try:
    r = topk_routing(logits, topk=k, score_function="sigmoid", num_groups=8, group_topk=4)
    names.append("topk_routing")
    r = topk_routing(logits, topk=k, capacity_factor=1.0)
    names.append("capacity")
    get_dispatch_layout(r.topk_idx, E, R)
    names.append("layout")
    perm = permute(x, r.topk_idx, E, topk_probs=r.topk_probs, num_out_rows=T * k)
    unpermute(perm.x, perm, probs=perm.probs)
    names.append("static permute")
    idx = torch.where(r.topk_idx < E // R, r.topk_idx, -1)[:512]
    m = S.mask_worst_case(x[:512], idx, r.topk_probs[:512], E // R)
    names.append("deepep mask")
    maps = expert_major_maps(m.recv_topk_idx, E // R, 512)
    y = to_expert_major(m.recv_x, maps, 512)
    from_expert_major(y, maps, m.recv_topk_probs)
    names.append("decode layout")
finally:
    torch.cuda.set_sync_debug_mode("default")
print("no host sync in: " + ", ".join(names))
EOF
run deepep_gpu 280 "$py" -m pytest tests/gpu/test_deepep_gpu.py -q -rs -p no:cacheprovider
run deepep_elastic_gpu 240 "$py" -m pytest tests/gpu/test_deepep_elastic_gpu.py -q -rs -p no:cacheprovider
run throughput 120 "$py" - <<'EOF'
import statistics
import time

import torch

from flexdispatch import permute, topk_routing, unpermute

dev = torch.device("cuda")
T, H, E, k = 16384, 7168, 256, 8


def ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


logits = torch.randn(T, E, device=dev)
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
r = topk_routing(logits, topk=k, score_function="sigmoid", num_groups=8, group_topk=4)
rows = torch.empty(T * k, H, device=dev, dtype=torch.bfloat16)
src = torch.randn(T * k, H, device=dev, dtype=torch.bfloat16)
lsrc, ldst = logits.clone(), torch.empty_like(logits)
t_copy_logits = ms(lambda: ldst.copy_(lsrc))
t_route = ms(lambda: topk_routing(logits, topk=k, score_function="sigmoid", num_groups=8,
                                  group_topk=4))
t_copy_rows = ms(lambda: (rows.copy_(src), rows.copy_(src)))


def permute_round():
    p = permute(x, r.topk_idx, E, num_out_rows=T * k)
    return unpermute(p.x, p)


t_perm = ms(permute_round)
gbps = 2 * T * k * H * 2 / (t_copy_rows * 1e-3) / 1e9
print(f"T={T} H={H} E={E} k={k}: routing {t_route:.3f} ms = {t_copy_logits / t_route:.2f} of a "
      f"logits copy; permute+unpermute {t_perm:.3f} ms = {t_copy_rows / t_perm:.2f} of 2 row "
      f"copies ({gbps:.0f} GB/s)")
EOF

echo "gpu_check: logs in $logs"
exit "$failed"
