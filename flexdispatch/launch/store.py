"""A rendezvous store on 127.0.0.1 only, for the single-node torchrun recipe (reliability-5 S11).

PyTorch's ``TCPStore`` listens on every interface when it binds its own socket, and torchrun
creates its stores that way (the rendezvous store, and the one it shares with the workers).
``scripts/launch/torchrun_single_node.sh`` therefore starts this store first and runs torchrun
against it as a client (``--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-conf
is_host=false --local-addr 127.0.0.1``, with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so that it
makes no store of its own); the workers' own store is then made by
``flexdispatch.distributed.join_launcher_group``, bound to 127.0.0.1 the same way
(``flexdispatch.distributed.loopback_store``). Nothing of the job listens beyond the loopback
interface.

    python -m flexdispatch.launch.store [--port PORT]

prints the port it listens on (``--port 0``, the default: a free one) on one line, closes its
standard output, and serves until its parent ends (the recipe, which becomes torchrun when it
``exec``s it): the parent-death signal, or a poll where there is none. It ignores SIGINT, SIGTERM
and SIGHUP (torchrun still needs it while it ends its workers).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flexdispatch.launch.store", description=__doc__)
    ap.add_argument("--port", type=int, default=0, help="the port (0: a free one)")
    args = ap.parse_args(argv)
    if not 0 <= args.port <= 65535:
        print(f"flexdispatch.launch.store: --port {args.port} is not a TCP port", file=sys.stderr)
        return 2
    from flexdispatch.distributed import loopback_store
    from flexdispatch.launch.lifetime import die_with_parent

    die_with_parent(os.getppid())  # NOTE: the recipe, which becomes torchrun (exec)
    try:
        store = loopback_store("127.0.0.1", args.port, True, None, 3600.0)
    except OSError as exc:
        print(
            f"flexdispatch.launch.store: cannot listen on 127.0.0.1:{args.port} "
            f"({exc.strerror or exc})",
            file=sys.stderr,
        )
        return 2
    print(store.port, flush=True)
    os.close(sys.stdout.fileno())  # NOTE: the reader sees the end of the line at once
    # NOTE: a Ctrl-C reaches the whole process group: torchrun still needs the store while it
    # ends its workers; this process ends with torchrun (the parent-death signal)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
