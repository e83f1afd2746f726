# Sourced by the torchrun recipes: resolves the interpreter and the launcher command.
#   PYTHON    interpreter (default: the venv's python, else python3)
#   TORCHRUN  launcher command (default: the venv's torchrun, else `$PYTHON -m torch.distributed.run`)
# Sets: root, venv, PYTHON, launcher (an array).
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${FLEXDISPATCH_VENV:-$root/.venv}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$venv/bin/python" ]]; then PYTHON=$venv/bin/python; else PYTHON=python3; fi
fi
if [[ -n "${TORCHRUN:-}" ]]; then
  read -r -a launcher <<<"$TORCHRUN"
elif [[ -x "$venv/bin/torchrun" && "$PYTHON" == "$venv/bin/python" ]]; then
  launcher=("$venv/bin/torchrun")
else
  launcher=("$PYTHON" -m torch.distributed.run)
fi
# check_devices L: before torchrun, compare L ranks on this node with the GPUs visible here
# (`python -m flexdispatch.devices`): refuse with one line and exit 2 when L > GPUs, unless
# FLEXDISPATCH_DEVICE=cpu, which also hides the GPUs from the workers (gloo on the CPU).
check_devices() {
  PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m flexdispatch.devices --ranks "$1" \
    || exit 2
  if [[ "${FLEXDISPATCH_DEVICE:-}" == cpu ]]; then
    export CUDA_VISIBLE_DEVICES=""
  fi
}
