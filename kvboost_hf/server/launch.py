"""``kvboost-hf serve`` / ``python -m kvboost_hf.server``: command-line flags and the uvicorn launch."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from pathlib import Path

from kvboost_hf.core.config import RecomputeStrategy

logger = logging.getLogger(__name__)
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
LOOPBACK = "127.0.0.1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the server's flags on ``parser``."""
    model = parser.add_argument_group("model and cache")
    model.add_argument("--model", default=None, help="local model directory or hub name (default: embedded model)")
    model.add_argument("--served-model-name", default=None, help="model id clients send (default: from --model)")
    model.add_argument("--chunk-size", type=int, default=128, help="tokens per cached chunk")
    model.add_argument(
        "--recompute-strategy", choices=[s.value for s in RecomputeStrategy], default=RecomputeStrategy.SELECTIVE.value
    )
    model.add_argument("--kv-cache-bits", type=int, choices=(16, 8, 4), default=16)
    model.add_argument("--max-cache-bytes", type=int, default=2 << 30, help="RAM budget of the chunk store (bytes)")
    model.add_argument("--disk-cache-dir", default=None, help="directory of the disk tier")
    model.add_argument("--remote-url", default=None, help="redis:// URL of the remote tier")
    model.add_argument("--disk-max-bytes", type=int, default=None, help="bytes of records the disk tier may hold")
    model.add_argument("--remote-prefix", default=None, help="prefix of every Redis key (default kvboost:)")
    model.add_argument("--remote-ttl-s", type=float, default=None, help="expiry of Redis keys written (seconds)")
    model.add_argument(
        "--remote-hmac-key-env",
        default=None,
        metavar="VAR",
        help="environment variable holding the secret that seals Redis records with HMAC-SHA256",
    )
    model.add_argument(
        "--reuse-mode",
        choices=("prefix", "chunk", "off"),
        default="prefix",
        help="prefix: exact prefix hits (outputs equal no reuse); chunk: also repaired non-prefix hits; off: none",
    )
    model.add_argument("--warm", type=Path, default=None, metavar="FILE", help="pre-load this text file's K/V")
    model.add_argument(
        "--draft-model", default=None, help="resident draft model (directory or hub name, same tokenizer as --model)"
    )
    model.add_argument("--num-draft-tokens", type=int, default=5, help="tokens the draft proposes per verify forward")
    serving = parser.add_argument_group("serving")
    serving.add_argument("--host", default=None, help=f"bind address (default {LOOPBACK})")
    serving.add_argument("--port", type=int, default=8000)
    serving.add_argument("--batch-window-ms", type=float, default=10.0, help="wait for same-prefix requests (ms)")
    serving.add_argument("--max-batch-size", type=int, default=8, help="rows generated at once")
    serving.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429")
    serving.add_argument("--default-max-tokens", type=int, default=256, help="budget when a request names none")
    serving.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens a request may ask")
    serving.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (413 beyond)")
    serving.add_argument(
        "--max-json-values", type=int, default=20_000, help="most JSON values in a request body (400 beyond)"
    )
    serving.add_argument("--header-timeout-s", type=float, default=10.0, help="time to send request headers (408)")
    serving.add_argument("--body-timeout-s", type=float, default=30.0, help="longest pause inside a body (408)")
    serving.add_argument("--shutdown-grace-s", type=float, default=10.0, help="time running requests get at shutdown")
    serving.add_argument(
        "--api-key", default=os.environ.get("KVBOOST_API_KEY"), help="required Bearer key (env KVBOOST_API_KEY)"
    )
    serving.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    serving.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def serve(args: argparse.Namespace) -> int:
    """Load the model, build the app and run uvicorn until interrupted (graceful shutdown on SIGINT/SIGTERM)."""
    import torch

    from kvboost_hf import KVBoost
    from kvboost_hf.server.app import GracefulServer, ServerSettings, create_app, uvicorn_config

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    host = args.host or LOOPBACK
    if args.api_key is None and not _is_loopback(host):
        logger.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
    engine = KVBoost.from_pretrained(
        args.model,
        chunk_size=args.chunk_size,
        recompute_strategy=args.recompute_strategy,
        kv_cache_bits=args.kv_cache_bits,
        max_cache_bytes=args.max_cache_bytes,
        disk_cache_dir=args.disk_cache_dir,
        remote_url=args.remote_url,
        disk_max_bytes=args.disk_max_bytes,
        remote_prefix=args.remote_prefix,
        remote_ttl_s=args.remote_ttl_s,
        remote_hmac_key=_secret_from_env(args.remote_hmac_key_env),
        draft_model=args.draft_model,
        num_draft_tokens=args.num_draft_tokens,
    )
    if args.draft_model is not None:
        logger.info(
            "draft model loaded: every batch is decoded speculatively with %d draft tokens per verify "
            "(rows with a grammar take one token per step)",
            args.num_draft_tokens,
        )
    if args.warm is not None:
        result = engine.warm(args.warm.read_text(encoding="utf-8"))
        logger.info("warmed %s: %d chunks of %d tokens", args.warm, result.chunks_stored, result.token_count)
    settings = ServerSettings(
        model_name=args.served_model_name or (Path(args.model).name if args.model else EMBEDDED_MODEL_NAME),
        api_key=args.api_key,
        reuse_mode=args.reuse_mode,
        batch_window_ms=args.batch_window_ms,
        max_batch_size=args.max_batch_size,
        max_queue=args.max_queue,
        default_max_tokens=args.default_max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_body_bytes=args.max_body_bytes,
        shutdown_grace_s=args.shutdown_grace_s,
        max_json_values=args.max_json_values,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
    )
    app = create_app(engine, settings)
    config = uvicorn_config(
        app,
        settings,
        host=host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5,  # the worker drains first (GracefulServer)
    )
    try:
        GracefulServer(config, app.state.drain).run()
    except KeyboardInterrupt:  # uvicorn re-raises the captured SIGINT after its graceful shutdown
        logger.info("server stopped")
    finally:
        engine.store.close()  # queued disk and Redis writes finish
    return 0


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
