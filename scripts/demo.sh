#!/usr/bin/env bash
# Set everything up (see scripts/setup.sh) and run `flexdispatch demo`. Arguments go to the demo.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
venv=${FLEXDISPATCH_VENV:-$root/.venv}
exec "$venv/bin/flexdispatch" demo "$@"
