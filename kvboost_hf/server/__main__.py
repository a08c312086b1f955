"""``python -m kvboost_hf.server [flags]``: the same as ``kvboost-hf serve [flags]``."""

from __future__ import annotations

import sys

from kvboost_hf.server.launch import parse_server_args, serve


def main(argv: list[str] | None = None) -> int:
    return serve(parse_server_args(argv, "python -m kvboost_hf.server", "OpenAI-compatible server"))


if __name__ == "__main__":
    sys.exit(main())
