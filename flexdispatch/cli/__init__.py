"""The ``flexdispatch`` command line."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexdispatch", description="MoE expert-parallel dispatch: demo, presets and tools."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from flexdispatch.cli import bench, config_cmd, demo, doctor, plan, presets_cmd

    demo.register(sub)
    plan.register(sub)
    presets_cmd.register(sub)
    doctor.register(sub)
    bench.register(sub)
    config_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"flexdispatch {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
