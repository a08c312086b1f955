"""``kvboost-hf serve`` / ``python -m kvboost_hf.server``: command-line flags and the uvicorn launch."""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.core.config import GENERATION_MODE_ALIASES, GenerationMode, RepairConfig
from kvboost_hf.core.errors import ConfigError, KVBoostError
from kvboost_hf.core.settings import add_settings_arguments, settings_from_args, settings_values
from kvboost_hf.hf.chat_segments import DocumentBoundaries
from kvboost_hf.hf.graphs import GraphConfig
from kvboost_hf.hf.speculative import TREE_EXPANSIONS, DraftConfig
from kvboost_hf.hf.tokens import TokenCacheConfig
from kvboost_hf.offload.settings import LayerStreamingConfig
from kvboost_hf.server.grammar import GrammarConfig
from kvboost_hf.server.settings import EMBEDDED_MODEL_NAME, ServerConfig
from kvboost_hf.store.config import StoreConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvboost_hf.engine import InferenceEngine

logger = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"

#: GraphConfig fields whose flags say "graph" (--graph-row-buckets, ...); --max-graphs says it already.
GRAPH_FLAG_PREFIXED = (
    "row_buckets",
    "query_buckets",
    "backend",
    "max_capacity",
    "max_capture_bytes",
    "draft_buckets",
    "look_ahead",
)

# Every settings dataclass the server is built from, with how its fields become flags: (class, group title,
# options of add_settings_arguments). Each field not excluded gets a generated flag whose default is the field's.
SETTINGS_FLAGS: tuple[tuple[type, str, dict], ...] = (
    (
        ChunkingConfig,
        "chunking",
        {
            "names": {"boundary_window": "chunk-boundary-window", "method": "chunking"},
            "choices": {"method": ("fixed", "content")},
            "exclude": ("boundary_token_ids",),  # taken from the tokenizer when --chunk-boundary-window > 0
        },
    ),
    (
        RepairConfig,
        "repair of non-prefix hits",
        {
            "names": {
                "strategy": "recompute-strategy",
                "ratio": "recompute-ratio",
                "check_layer": "recompute-check-layer",
                "overlap_k": "recompute-overlap-k",
                "head_tokens": "recompute-head-tokens",
                "filter_layers": "recompute-filter-layers",
                "deviation": "recompute-deviation",
            },
            "choices": {"deviation": ("key", "value")},
        },
    ),
    (
        StoreConfig,
        "chunk store",
        {
            "names": {"max_bytes": "max-cache-bytes", "device": "store-device"},
            "exclude": ("remote_hmac_key",),  # a secret: named by --remote-hmac-key-env, never on the command line
        },
    ),
    (
        DraftConfig,
        "speculative decoding",
        {
            "names": {"early_exit_layers": "draft-early-exit"},
            "choices": {"tree_expansion": TREE_EXPANSIONS},
            "exclude": ("confidence_threshold", "schedule"),  # transformers' assisted generation only
        },
    ),
    (
        LayerStreamingConfig,
        "layer streaming (with --stream-layers)",
        {
            "names": {
                name: "stream-" + name.replace("_", "-")
                for name in (
                    "keep_first_k",
                    "keep_last_k",
                    "num_slots",
                    "pin_memory",
                    "device_memory_budget_bytes",
                    "device",
                )
            }
        },
    ),
    (
        ServerConfig,
        "serving",
        {
            "choices": {
                "reuse_mode": (*(mode.value for mode in GenerationMode), *GENERATION_MODE_ALIASES),
                "document_boundaries": tuple(b.value for b in DocumentBoundaries),
            },
            # --served-model-name (default from --model), --api-key (env); grammar_limits: the group below
            "exclude": ("model_name", "api_key", "grammar_limits"),
        },
    ),
    (
        GrammarConfig,
        "structured output and tool calls",
        {"names": {name: "grammar-" + name.replace("_", "-") for name in ("workers", "max_waiting", "cache_entries")}},
    ),
    (TokenCacheConfig, "prompt token ids cache", {"names": {"max_bytes": "token-cache-max-bytes"}}),
    (
        GraphConfig,
        "compiled graphs of decode steps and short prefills (--graphs / --no-graphs turns them on or off)",
        {
            # enabled: --graphs / --no-graphs in the model group, whose default depends on the model's device
            "exclude": ("enabled",),
            "names": {name: "graph-" + name.replace("_", "-") for name in GRAPH_FLAG_PREFIXED},
        },
    ),
)


def add_forward_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Register ``--graphs`` / ``--no-graphs`` and ``--attn-implementation`` (both default None: the device's
    default), how the server's model runs its forwards; ``bench serve`` registers them too, to pass them on."""
    parser.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run decode steps and short prefills as compiled (CUDA) graphs (default: on when the model is on CUDA; "
        "--no-graphs with --attn-implementation kvboost lets a GPU server pack its forwards)",
    )
    parser.add_argument(
        "--attn-implementation",
        default=None,
        metavar="NAME",
        help='the model\'s attention, e.g. "kvboost", "sdpa", "eager" (default: "kvboost" on the CPU, '
        "transformers' own elsewhere)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the server's flags on ``parser``: model and process flags, then one per settings field."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, help="local model directory or hub name (default: embedded model)")
    model.add_argument("--served-model-name", default=None, help="model id clients send (default: from --model)")
    model.add_argument("--warm", type=Path, default=None, metavar="FILE", help="pre-load this text file's K/V")
    model.add_argument(
        "--draft-model", default=None, help="resident draft model (directory or hub name, same tokenizer as --model)"
    )
    model.add_argument(
        "--remote-hmac-key-env",
        default=None,
        metavar="VAR",
        help="environment variable holding the secret that seals Redis records with HMAC-SHA256",
    )
    model.add_argument("--stream-layers", action="store_true", help="stream decoder layers from host memory")
    add_forward_arguments(model)
    process = parser.add_argument_group("process")
    process.add_argument("--host", default=None, help=f"bind address (default {LOOPBACK})")
    process.add_argument("--port", type=int, default=8000)
    process.add_argument(
        "--api-key", default=os.environ.get("KVBOOST_API_KEY"), help="required Bearer key (env KVBOOST_API_KEY)"
    )
    process.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    process.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    for cls, title, options in SETTINGS_FLAGS:
        add_settings_arguments(parser.add_argument_group(title), cls, **options)


def build_engine(args: argparse.Namespace) -> InferenceEngine:
    """The engine the flags describe (model and its attention, chunking, repair, store, draft, streaming, token cache
    and graph settings)."""
    from kvboost_hf.engine import InferenceEngine, graphs_by_default, load_model

    streaming = settings_from_args(LayerStreamingConfig, args) if args.stream_layers else None
    model, tokenizer = load_model(args.model, streaming=streaming, attn_implementation=args.attn_implementation)
    graphs = args.graphs if args.graphs is not None else graphs_by_default(model.device)
    chunking = settings_values(ChunkingConfig, args)
    return InferenceEngine(
        model,
        tokenizer,
        chunking=ChunkingConfig.from_tokenizer(
            tokenizer, chunking["chunk_size"], chunking["boundary_window"], chunking["method"]
        ),
        repair=settings_from_args(RepairConfig, args),
        store=settings_from_args(StoreConfig, args, remote_hmac_key=_secret_from_env(args.remote_hmac_key_env)),
        draft_model=args.draft_model,
        draft=settings_from_args(DraftConfig, args),
        token_cache=settings_from_args(TokenCacheConfig, args),
        graphs=settings_from_args(GraphConfig, args, enabled=graphs),
    )


def parse_server_args(argv: list[str] | None, prog: str, description: str) -> argparse.Namespace:
    """The server's flags parsed from ``argv`` (None: ``sys.argv``) by a parser named ``prog``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    return parser.parse_args(argv)


def server_settings(args: argparse.Namespace) -> ServerConfig:
    """The :class:`ServerConfig` the flags describe (model name defaults to the model's directory name)."""
    return settings_from_args(
        ServerConfig,
        args,
        model_name=args.served_model_name or (Path(args.model).name if args.model else EMBEDDED_MODEL_NAME),
        api_key=args.api_key,
        grammar_limits=settings_from_args(GrammarConfig, args),
    )


def check_settings(args: argparse.Namespace) -> None:
    """Build every settings object the flags describe, without a model, and check that ``--warm`` names a readable
    file, so a bad value is a ConfigError naming it before the model loads (it was a traceback after). What needs
    the model (the chunk boundary tokens, a draft's layers) is checked when the engine is built."""
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    if args.warm is not None and not (args.warm.is_file() and os.access(args.warm, os.R_OK)):
        found = "a directory" if args.warm.is_dir() else "not readable" if args.warm.exists() else "not found"
        raise ConfigError(f"--warm must name a readable text file, got {args.warm} ({found})")
    if args.warm is not None:
        try:
            args.warm.read_text(encoding="utf-8")  # read again once the model is loaded
        except UnicodeDecodeError as error:
            raise ConfigError(f"--warm must name a UTF-8 text file, got {args.warm} ({error})") from None
    boundary_window = settings_values(ChunkingConfig, args)["boundary_window"]
    ChunkingConfig(**{**settings_values(ChunkingConfig, args), "boundary_window": 0})
    if boundary_window < 0:
        raise ConfigError(f"--chunk-boundary-window must be >= 0, got {boundary_window}")
    for cls in (RepairConfig, StoreConfig, DraftConfig, TokenCacheConfig, GraphConfig, LayerStreamingConfig):
        settings_from_args(cls, args)
    server_settings(args)


def build_app(args: argparse.Namespace) -> tuple[FastAPI, InferenceEngine]:
    """Load the engine the flags describe (warmed with ``--warm``) and build the app serving it; the caller runs
    the app and closes ``engine.store`` when done. Logs what the draft and the warm file did."""
    from kvboost_hf.server.app import create_app

    engine = build_engine(args)
    if args.draft_model is not None:
        logger.info(
            "draft model loaded: every batch is decoded speculatively with %d draft tokens per verify "
            "(rows with a grammar take one token per step)",
            engine.draft_settings.num_draft_tokens,
        )
    if args.warm is not None:
        result = engine.warm(args.warm.read_text(encoding="utf-8"))
        logger.info("warmed %s: %d chunks of %d tokens", args.warm, result.chunks_stored, result.token_count)
    return create_app(engine, server_settings(args)), engine


def freeze_startup_heap() -> int:
    """Exempt the objects alive now (once the model is loaded: transformers', torch's and the engine's, ~445k for
    the embedded model) from every later garbage collection (``gc.freeze()``, after one last collection); returns
    how many. A full collection walks every tracked object: 100-260 ms measured in a serving process on this 2-core
    machine, paid inside whichever decode step it interrupts. These objects live as long as the process, so
    scanning them again finds nothing. Called by the serving processes only (the server, each Ray replica), never
    by library code: a frozen object in a reference cycle is not reclaimed until ``gc.unfreeze()``."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("froze %d startup objects out of garbage collection", frozen)
    return frozen


def configure_process(args: argparse.Namespace) -> None:
    """Logging format and level, and torch's thread count, from the flags (once per serving process)."""
    import torch

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)


def serve(args: argparse.Namespace) -> int:
    """Load the model, build the app and run uvicorn until interrupted (graceful shutdown on SIGINT/SIGTERM)."""
    from kvboost_hf.server.app import GracefulServer, uvicorn_config

    try:
        check_settings(args)
    except KVBoostError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_process(args)
    host = args.host or LOOPBACK
    warn_if_open(host, args.api_key)
    app, engine = build_app(args)
    freeze_startup_heap()
    settings: ServerConfig = app.state.settings
    config = uvicorn_config(
        app,
        settings,
        host=host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5,  # the worker shuts down first (GracefulServer)
    )
    try:
        GracefulServer(config, app.state.shutdown_worker).run()
    except KeyboardInterrupt:  # uvicorn re-raises the captured SIGINT after its graceful shutdown
        logger.info("server stopped")
    finally:
        engine.store.close()  # queued disk and Redis writes finish
    return 0


def warn_if_open(host: str, api_key: str | None) -> None:
    """Warn when ``host`` is reachable from other machines and no API key is required."""
    if api_key is None and not _is_loopback(host):
        logger.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _secret_from_env(variable: str | None) -> str | None:
    """The secret in environment ``variable`` (None when no variable is named); a clear error if it is unset."""
    if variable is None:
        return None
    secret = os.environ.get(variable)
    if not secret:
        raise SystemExit(f"--remote-hmac-key-env names {variable}, which is unset or empty")
    return secret
