"""``flexdispatch config``: turn a published model config into a flexdispatch ``MoEConfig`` YAML.

Shape letters (ARCHITECTURE.md): E experts · k top-k · H hidden size.

Usage::

    flexdispatch config --from-hf config.json [--name NAME] [--output FILE] [--json]
    flexdispatch config --from-megatron args.{json,yaml} [--name NAME] [--output FILE] [--json]

``--from-hf`` reads a Hugging Face ``config.json`` (or the folder holding it) through
``flexdispatch.importers.moe_config_from_hf``; ``--from-megatron`` reads a JSON or YAML mapping of
Megatron-Core argument names (``vars(args)`` of a training run) through
``moe_config_from_megatron``. The YAML (``importers.to_yaml``) goes to stdout, or to ``--output``;
``load_config`` reads it back to an equal config, so it can be passed to ``--preset``/``--config``
of the other sub-commands. ``--json`` prints the same fields as a JSON object instead (which
``MoEConfig.model_validate`` reads back). A missing file, a key of the wrong type, an unknown
``model_type`` or an argument the importer cannot map is an error with exit code 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["register", "run", "read_megatron_args"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``config`` sub-command to ``sub``."""
    p = sub.add_parser(
        "config",
        help="print the MoEConfig YAML of a Hugging Face or Megatron model config",
        description="Import a Hugging Face config.json or a Megatron-Core argument file and print "
        "the flexdispatch MoEConfig as YAML.",
        epilog=_supported_epilog(),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="FILE", help="Hugging Face config.json (or its folder)")
    src.add_argument(
        "--from-megatron",
        metavar="FILE",
        help="JSON or YAML mapping of Megatron-Core argument names",
    )
    p.add_argument("--name", default=None, help="MoEConfig.name (default: model_type / 'megatron')")
    p.add_argument("--output", "-o", default=None, help="write the YAML here instead of stdout")
    p.add_argument("--json", action="store_true", help="print (or write) the config as JSON")
    p.set_defaults(func=run)


def _supported_epilog() -> str:
    from flexdispatch.importers import supported_model_types

    return "Hugging Face model types --from-hf imports: " + ", ".join(supported_model_types())


def read_megatron_args(path: str | Path) -> dict[str, Any]:
    """The mapping stored in a Megatron argument file (``.json``; anything else is read as YAML).

    Raises:
        ValueError: the file is missing, does not parse, or does not hold a mapping.
    """
    from flexdispatch._checks.config_text import read_config_file
    from flexdispatch._checks.files import file_error

    path = Path(path)
    kind = "json" if path.suffix == ".json" else "yaml"
    data = read_config_file(path, kind=kind, what="Megatron argument file")
    if not isinstance(data, dict):
        raise file_error(
            "Megatron argument file",
            path,
            f"must hold a mapping of argument names, got {type(data).__name__}",
        )
    return data


def run(args: argparse.Namespace) -> int:
    """Print (or write) the YAML; ValueError (exit 2) on bad input."""
    from flexdispatch.cli._common import check_output_path, option_scope, write_output
    from flexdispatch.importers import moe_config_from_hf, moe_config_from_megatron, to_yaml

    given = args.from_hf if args.from_hf is not None else args.from_megatron
    inputs = [given, Path(given) / "config.json"]  # NOTE: the file, or the folder's config.json
    if args.output:
        check_output_path(args.output, "--output", inputs=inputs)
    if args.from_hf is not None:
        with option_scope("--from-hf", args.from_hf):
            cfg = moe_config_from_hf(args.from_hf, name=args.name)
    else:
        with option_scope("--from-megatron", args.from_megatron):
            data = read_megatron_args(args.from_megatron)
            kwargs = {} if args.name is None else {"name": args.name}
            cfg = moe_config_from_megatron(data, **kwargs)
    if getattr(args, "json", False):
        text = json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n"
    else:
        text = to_yaml(cfg)
    if args.output:
        write_output(args.output, text, "--output", inputs=inputs)
    else:
        print(text, end="")
    return 0
