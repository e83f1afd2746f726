# Sourced by the torchrun recipes: checks the environment they read, resolves the interpreter and
# the launcher command.
#   PYTHON    interpreter (default: the venv's python, else python3)
#   TORCHRUN  launcher command (default: the venv's torchrun, else `$PYTHON -m torch.distributed.run`)
# Sets: root, venv, PYTHON, launcher (an array), and exports TORCH_ELASTIC_SHUTDOWN_TIMEOUT.
# Every variable a recipe reads is checked before anything starts: a bad one is one line on stderr
# naming it and what to pass (`refuse`), exit 2.
me=$(basename "$0")
refuse() {  # refuse VAR MESSAGE: one line, exit 2
  printf '%s: %s=%q %s\n' "$me" "$1" "${!1-}" "$2" >&2
  exit 2
}
# check_int VAR LOW HIGH WHAT [HINT]: VAR, when set, is a decimal integer in [LOW, HIGH]
check_int() {
  local value=${!1-}
  [[ -z "$value" ]] && return 0
  if [[ ! "$value" =~ ^[0-9]{1,9}$ ]] || (( 10#$value < $2 || 10#$value > $3 )); then
    refuse "$1" "is not $4: pass an integer in [$2, $3]${5:+ ($5)}"
  fi
}
# check_int_list VAR LOW HIGH WHAT: VAR, when set, is a comma-separated list of decimal integers
# in [LOW, HIGH] (OpenMP's OMP_NUM_THREADS=4,2: threads per nesting level)
check_int_list() {
  local value=${!1-} item
  [[ -z "$value" ]] && return 0
  if [[ ! "$value" =~ ^[0-9]{1,9}(,[0-9]{1,9})*$ ]]; then
    refuse "$1" "is not $4: pass an integer in [$2, $3] (or a list of them, e.g. 4,2)"
  fi
  IFS=, read -r -a items <<<"$value"
  for item in "${items[@]}"; do
    if (( 10#$item < $2 || 10#$item > $3 )); then
      refuse "$1" "is not $4: pass an integer in [$2, $3] (or a list of them, e.g. 4,2)"
    fi
  done
}
# is_ipv6 TEXT: TEXT is an IPv6 literal without brackets: eight groups of 1-4 hex digits, or
# fewer around one `::`, and an optional %zone
is_ipv6() {
  local a=${1%%\%*} side n=0 colons
  if [[ "$1" == *%* && ! "${1#*%}" =~ ^[0-9A-Za-z_.-]+$ ]]; then return 1; fi
  if [[ "$a" != *::* ]]; then
    [[ "$a" =~ ^[0-9A-Fa-f]{1,4}(:[0-9A-Fa-f]{1,4}){7}$ ]]
    return
  fi
  [[ "$a" == *::*::* ]] && return 1
  for side in "${a%%::*}" "${a#*::}"; do
    [[ -z "$side" ]] && continue
    [[ "$side" =~ ^[0-9A-Fa-f]{1,4}(:[0-9A-Fa-f]{1,4})*$ ]] || return 1
    colons=${side//[^:]/}
    n=$(( n + ${#colons} + 1 ))
  done
  (( n <= 7 ))
}
# check_host VAR WHAT: VAR is a host alone (no port): a host name, an IPv4 address or an IPv6 one
# (bracketed or not); host:PORT is refused, saying the port goes in MASTER_PORT
check_host() {
  local value=${!1-}
  [[ "$value" =~ ^[0-9A-Za-z_.%-]+$ ]] && return 0
  is_ipv6 "$value" && return 0
  [[ "$value" =~ ^\[(.*)\]$ ]] && is_ipv6 "${BASH_REMATCH[1]}" && return 0
  if [[ "$value" =~ ^(\[[^]]*\]|[^:]+):[0-9]+$ ]]; then
    refuse "$1" "is host:port: pass $2 alone and the port in MASTER_PORT"
  fi
  refuse "$1" "is not a host name or address: pass $2 (a host name, an IPv4 or an IPv6 address)"
}
# check_endpoint VAR WHAT: VAR is HOST or HOST:PORT, HOST a host name, an IPv4 address or a
# bracketed IPv6 one, PORT in [1, 65535]
check_endpoint() {
  local value=${!1-} host port=1
  if [[ "$value" =~ ^(\[[^]]*\]|[^:]*)(:([0-9]{1,5}))?$ ]]; then
    host=${BASH_REMATCH[1]} port=${BASH_REMATCH[3]:-1}
  fi
  if [[ -z "$host" ]] || (( 10#$port < 1 || 10#$port > 65535 )) \
    || ! { [[ "$host" =~ ^[0-9A-Za-z_.%-]+$ ]] \
           || { [[ "$host" =~ ^\[(.*)\]$ ]] && is_ipv6 "${BASH_REMATCH[1]}"; }; }; then
    refuse "$1" "is not a host:port endpoint: pass $2 (an IPv6 host in brackets)"
  fi
}
check_port() {  # MASTER_PORT: 0 would hang (torchrun waits for a store nobody serves)
  check_int MASTER_PORT 1 65535 "a TCP port" "0 makes torchrun wait forever"
}
check_ifname() {  # check_ifname VAR: VAR, when set, names interfaces of this machine (a,b,...)
  local value=${!1-} name
  [[ -z "$value" || ! -d /sys/class/net ]] && return 0
  IFS=, read -r -a names <<<"$value"
  for name in "${names[@]}"; do
    if [[ ! "$name" =~ ^[A-Za-z0-9_.:@-]+$ || ! -e "/sys/class/net/$name" ]]; then
      refuse "$1" "is not a network interface of this machine (it has: $(ls /sys/class/net | paste -sd, -))"
    fi
  done
}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ -n "${FLEXDISPATCH_VENV:-}" && ! -d "$FLEXDISPATCH_VENV" ]]; then
  refuse FLEXDISPATCH_VENV "is not a folder: point it at the virtual environment (scripts/setup.sh makes .venv)"
fi
venv=${FLEXDISPATCH_VENV:-$root/.venv}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$venv/bin/python" ]]; then PYTHON=$venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; then
  refuse PYTHON "does not run Python 3.10+: point PYTHON at the interpreter that has torch and flexdispatch (e.g. .venv/bin/python)"
fi
if [[ -n "${TORCHRUN:-}" ]]; then
  read -r -a launcher <<<"$TORCHRUN"
  if [[ ${#launcher[@]} -eq 0 ]] || ! command -v "${launcher[0]}" >/dev/null 2>&1; then
    refuse TORCHRUN "is not a command: unset it (the venv's torchrun or \$PYTHON -m torch.distributed.run is used)"
  fi
  # NOTE: a command that is not torchrun (/bin/false, a typo for another tool) would fail after
  # the checks with nothing naming it: its --help must list torchrun's --nproc-per-node
  help=$( (if command -v timeout >/dev/null 2>&1; then timeout 60 "${launcher[@]}" --help; else "${launcher[@]}" --help; fi) 2>&1 || true)
  if [[ "$help" != *--nproc-per-node* && "$help" != *--nproc_per_node* ]]; then
    refuse TORCHRUN "does not run torchrun (its --help does not list --nproc-per-node): unset it, or point it at torchrun"
  fi
elif [[ -x "$venv/bin/torchrun" && "$PYTHON" == "$venv/bin/python" ]]; then
  launcher=("$venv/bin/torchrun")
else
  launcher=("$PYTHON" -m torch.distributed.run)
fi
case "${FLEXDISPATCH_CMD:-demo}" in
  demo|bench|doctor|plan|presets|config) ;;
  *) refuse FLEXDISPATCH_CMD "is not a flexdispatch sub-command: use demo, bench, doctor, plan, presets or config" ;;
esac
case "${FLEXDISPATCH_DEVICE:-}" in
  ""|auto|cpu|cuda|AUTO|CPU|CUDA) ;;
  *) refuse FLEXDISPATCH_DEVICE "is not a device choice: use cpu, cuda or auto" ;;
esac
case "${FLEXDISPATCH_DRY_RUN:-0}" in
  0|1) ;;
  *) refuse FLEXDISPATCH_DRY_RUN "must be 1 (print the command) or 0" ;;
esac
check_int NPROC_PER_NODE 1 4096 "a number of processes"
check_int_list OMP_NUM_THREADS 1 4096 "a number of threads"
check_int TORCH_ELASTIC_SHUTDOWN_TIMEOUT 0 86400 "a number of seconds"
check_ifname FLEXDISPATCH_IFNAME
check_ifname GLOO_SOCKET_IFNAME
# NOTE: a worker that ignores SIGTERM is SIGKILLed after this many seconds when torchrun itself is
# signalled (torchrun's default is 30). When a worker fails, torchrun waits a fixed 30 s whatever
# this says: what ends a stopped peer then is the failing worker, which SIGKILLs the stopped
# workers of its job (flexdispatch.launch.lifetime.end_stopped_local_peers; docs/security.md)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-5}
# store_note: one line on stderr, on a single node, saying where torchrun's store listens
store_note() {
  local where="a free port"
  [[ -n "${MASTER_PORT:-}" ]] && where="port $MASTER_PORT"
  echo "$me: note: torchrun's rendezvous store listens on every interface ($where), not only 127.0.0.1: PyTorch's TCPStore server binds the wildcard address and torchrun has no option to bind it; the workers' own sockets are on ${GLOO_SOCKET_IFNAME:-lo}. On a machine others can reach, run flexdispatch demo / bench without torchrun (loopback only) or firewall the port (docs/security.md)" >&2
}
# check_devices L: before torchrun, compare L ranks on this node with the GPUs visible here
# (`python -m flexdispatch.launch.devices`): refuse with one line and exit 2 when L > GPUs, unless
# FLEXDISPATCH_DEVICE=cpu, which also hides the GPUs from the workers (gloo on the CPU).
check_devices() {
  local rc=0
  PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m flexdispatch.launch.devices --ranks "$1" \
    || rc=$?
  if (( rc == 2 )); then
    exit 2  # NOTE: flexdispatch.launch.devices said why, in one line
  elif (( rc != 0 )); then
    refuse PYTHON "could not run 'python -m flexdispatch.launch.devices' (exit $rc): install flexdispatch for it (bash scripts/setup.sh)"
  fi
  if [[ "${FLEXDISPATCH_DEVICE:-}" == cpu ]]; then
    export CUDA_VISIBLE_DEVICES=""
  fi
}
