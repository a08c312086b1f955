"""``python -m kvboost_hf.server [flags]``: the same as ``kvboost-hf serve [flags]``."""

from __future__ import annotations

import argparse
import sys

from kvboost_hf.server.launch import add_arguments, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvboost_hf.server", description="OpenAI-compatible server")
    add_arguments(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
