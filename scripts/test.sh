#!/usr/bin/env bash
# Set everything up (see scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# NOTE: the plug-in tests need Megatron-Core, torchtitan, vLLM and SGLang (scripts/setup.sh)
FLEXDISPATCH_INTEGRATIONS=${FLEXDISPATCH_INTEGRATIONS:-1} bash "$root/scripts/setup.sh"
venv=${FLEXDISPATCH_VENV:-$root/.venv}
cd "$root"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
