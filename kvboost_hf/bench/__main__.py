"""Dispatch ``python -m kvboost_hf.bench NAME [args...]`` to ``kvboost_hf.bench.NAME.main``."""

from __future__ import annotations

import importlib
import sys

from kvboost_hf.core.errors import ConfigError

BENCHMARKS = (
    "multiturn",
    "tokenizing",
    "long_context",
    "rag",
    "rag_accuracy",
    "rag_server",
    "tiers",
    "attention",
    "serve",
    "serve_ray",
    "streaming",
    "decode",
    "speculative",
    "hardening",
    "awq",
    "detokenize",
    "gpu",
)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in BENCHMARKS:
        print(f"usage: python -m kvboost_hf.bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"kvboost_hf.bench.{args[0]}")
    except ModuleNotFoundError as exc:
        if exc.name == f"kvboost_hf.bench.{args[0]}":
            print(f"benchmark {args[0]!r} is not implemented yet", file=sys.stderr)
            return 2
        raise
    try:
        return int(module.main(args[1:]) or 0)
    except ConfigError as exc:  # a setting the flags describe is out of range: a usage error, not a traceback
        print(f"python -m kvboost_hf.bench {args[0]}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
