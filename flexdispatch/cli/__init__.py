"""The ``flexdispatch`` command line."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from flexdispatch.cli._common import CliParser

    parser = CliParser(
        prog="flexdispatch", description="MoE expert-parallel dispatch: demo, presets and tools."
    )
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    parser.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CliParser)
    from flexdispatch.cli import bench, config_cmd, demo, doctor, plan, presets_cmd

    demo.register(sub)
    plan.register(sub)
    presets_cmd.register(sub)
    doctor.register(sub)
    bench.register(sub)
    config_cmd.register(sub)
    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
        p.add_argument(
            "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE_HELP
        )
    return parser


_DEBUG_HELP = "on an error, print the traceback too (or set FLEXDISPATCH_DEBUG=1)"
_VERBOSE_HELP = (
    "print each step on stderr and, on an error, how it was worked out below the one error line "
    "(or set FLEXDISPATCH_VERBOSE=1)"
)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; every error is one line on stderr and a non-zero exit code."""
    _die_with_launcher()  # NOTE: first: before anything imports torch (seconds)
    from flexdispatch.cli._common import CliError, print_error

    parser = build_parser()
    args = parser.parse_args(argv)
    watch = _StdoutWatch(sys.stdout)
    sys.stdout = watch  # type: ignore[assignment]
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # NOTE: here, so that a full disk or device is reported (below)
        return code
    except BrokenPipeError:  # NOTE: the reader went away (`| head`): nothing left to say
        _drop_stdout(watch.stream)
        return 0
    except KeyboardInterrupt:
        print(f"flexdispatch {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc is not watch.failed:
            return print_error(args.command, exc, args)
        _drop_stdout(watch.stream)
        failed = CliError(
            f"cannot write to standard output: {exc.strerror or exc}",
            fix="redirect it to a file that can be written",
        )
        return print_error(args.command, failed, args)
    except Exception as exc:
        _end_stopped_peers(exc)
        return print_error(args.command, exc, args)
    finally:
        if sys.stdout is watch:
            sys.stdout = watch.stream


class _StdoutWatch:
    """Standard output, remembering the error a write or flush raised (so that the message can
    say it was standard output: a full disk, ``/dev/full``)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.failed: OSError | None = None

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)  # type: ignore[no-any-return]
        except OSError as exc:
            self.failed = exc
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as exc:
            self.failed = exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _drop_stdout(stream: Any) -> None:
    """Point standard output (``stream``'s descriptor) at the null device: nothing more can
    reach the reader, and the interpreter's flush at exit must not fail again."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def _die_with_launcher() -> None:
    """A torchrun worker ends with its agent, however the agent ends (a SIGKILLed torchrun
    otherwise leaves its workers running until their process-group timeout), also one that ended
    before this worker got here (``flexdispatch.launch.lifetime.die_with_agent``: the pid the
    launch recipes record). Run first, so that the worker is tied to its agent from the
    interpreter's start, not after the seconds its imports take. Only a process that is provably
    a worker (``lifetime.torchrun_worker``) is tied; nothing without a launcher.

    Under a launcher's environment (``RANK`` and ``WORLD_SIZE`` set) it also sets
    ``TORCH_CPP_LOG_LEVEL=ERROR`` unless the user set it, before torch is imported: c10d's C++
    warnings (a store that cannot connect prints dozens of lines of native frames) would bury
    the command line's one-line error."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and not (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ
    ):
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from flexdispatch.launch.lifetime import die_with_agent

    die_with_agent()


def _end_stopped_peers(exc: BaseException) -> None:
    """This worker fails in a collective (``CollectiveError``: a peer hung, died or stopped):
    end the stopped workers of its own job on this node
    (``flexdispatch.launch.lifetime.end_stopped_local_peers``), so that torchrun ends the job now
    rather than after its 30 s grace (the job is over either way). Never for any other error (bad
    input, a file, a refusal): those touch no other process. Nothing unless this process is a
    torchrun worker."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not _collective_failure(exc):
        return
    from flexdispatch.launch.lifetime import end_stopped_local_peers

    end_stopped_local_peers()


def _collective_failure(exc: BaseException | None) -> bool:
    """``exc`` is, or was raised from, a failed collective (``CollectiveError``)."""
    module = sys.modules.get("flexdispatch.distributed")  # NOTE: none raised if not imported
    if module is None:
        return False
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, module.CollectiveError):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
