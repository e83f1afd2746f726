"""``flexdispatch presets``: list the shipped presets or print one as YAML."""

from __future__ import annotations

import argparse

import yaml

from flexdispatch.config import list_presets, load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("presets", help="list presets, or print one (validated) as YAML")
    p.add_argument("name", nargs="?", help="preset name or YAML path to print")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.name is None:
        for name in list_presets():
            cfg = load_config(name)
            r = cfg.router
            groups = f", {r.group_topk}/{r.num_groups} groups" if r.num_groups else ""
            print(
                f"{name:<20} E={r.num_experts:<4} k={r.topk:<2} H={cfg.hidden_size:<5} "
                f"{r.score_function}{groups}"
            )
        return 0
    from flexdispatch.cli._common import option_scope

    with option_scope("", args.name):
        cfg = load_config(args.name)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0
