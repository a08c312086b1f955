"""The ``kvboost-hf`` command. ``COMMANDS`` maps each subcommand to its help and module; the module provides
``add_arguments(parser)`` and a runner function named like the subcommand (returning an exit status)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("run the OpenAI-compatible server", "kvboost_hf.server.launch"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvboost-hf", description="Chunk-level K/V reuse for Hugging Face models")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, module_name) in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub)
        runner: Callable[[argparse.Namespace], int] = getattr(module, name)
        sub.set_defaults(run=runner)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
