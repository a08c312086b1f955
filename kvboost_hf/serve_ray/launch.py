"""``python -m kvboost_hf.serve_ray``: the server's flags plus the replica and routing flags; runs the Ray Serve
application until interrupted."""

from __future__ import annotations

import argparse
import logging
import math
import signal
import threading
from typing import TYPE_CHECKING, Any, cast

from kvboost_hf.core.errors import KVBoostError
from kvboost_hf.serve_ray.routing import DEFAULT_FALLBACK, DEFAULT_IMBALANCE_THRESHOLD, FALLBACKS
from kvboost_hf.server.launch import (
    LOOPBACK,
    add_arguments,
    check_settings,
    configure_process,
    server_settings,
    warn_if_open,
)

if TYPE_CHECKING:
    from ray.serve import Deployment

logger = logging.getLogger(__name__)
APP_NAME = "kvboost"
ROUTINGS = ("prefix", "round_robin", "power_of_two")
#: Seconds a stopping replica or ingress waits before it checks for requests still running, and between checks
#: (Ray Serve's ``graceful_shutdown_wait_loop_s``, its default): the first wait lets requests already routed to it
#: arrive. A shorter one stops faster (``serve.shutdown()`` of 2 replicas and the ingress: 7.8 s with this default,
#: 1.3 s with 0.2 s, measured on a 2-core CPU machine) and risks refusing a request routed just before.
DEFAULT_SHUTDOWN_WAIT_S = 2.0
ROUTER_CLASSES = {
    "prefix": "kvboost_hf.serve_ray.routers.ChunkAffinityRouter",
    "round_robin": "kvboost_hf.serve_ray.routers.RoundRobinRouter",
    "power_of_two": None,  # Ray Serve's default PowerOfTwoChoicesRequestRouter
}


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the replica and routing flags (the single server's flags are added by ``add_arguments``)."""
    group = parser.add_argument_group("replicas (Ray Serve)")
    group.add_argument("--replicas", type=int, default=2, help="engine replicas (one per GPU, or CPU processes)")
    group.add_argument("--routing", choices=ROUTINGS, default="prefix", help="how requests are placed on replicas")
    group.add_argument(
        "--imbalance-threshold",
        type=int,
        default=DEFAULT_IMBALANCE_THRESHOLD,
        help="prefix routing: in-flight requests by which replicas may differ before load decides",
    )
    group.add_argument("--fallback", choices=FALLBACKS, default=DEFAULT_FALLBACK, help="prefix routing without a match")
    group.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica")
    group.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica (1: one replica per GPU)")
    group.add_argument("--max-ongoing-requests", type=int, default=16, help="requests a replica accepts at once")
    group.add_argument("--max-attempts", type=int, default=3, help="replicas tried for a request whose replica died")
    group.add_argument(
        "--shutdown-wait-s",
        type=float,
        default=DEFAULT_SHUTDOWN_WAIT_S,
        help="a stopping replica or ingress waits this long, then again while requests still run, before it stops",
    )
    group.add_argument(
        "--address", default=None, help="Ray cluster to join (default: start a local Ray with --num-cpus CPUs)"
    )
    group.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")


#: The least value of each replica and routing flag (a flag left unset, ``--num-cpus``'s default, is not checked).
RAY_FLAG_MINIMUMS = {
    "replicas": 1,
    "imbalance_threshold": 0,
    "replica_cpus": 0,
    "replica_gpus": 0,
    "max_ongoing_requests": 1,
    "max_attempts": 1,
    "shutdown_wait_s": 0,
    "num_cpus": 1,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked before Ray starts: a replica or routing flag below its least value, or a server flag
    :func:`~kvboost_hf.server.launch.check_settings` refuses, is a usage error naming it (exit 2)."""
    parser = argparse.ArgumentParser(
        prog="python -m kvboost_hf.serve_ray", description="OpenAI-compatible server on Ray Serve replicas"
    )
    add_arguments(parser)
    add_ray_arguments(parser)
    args = parser.parse_args(argv)
    for name, minimum in RAY_FLAG_MINIMUMS.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= minimum):
            parser.error(f"--{name.replace('_', '-')} must be a number >= {minimum}, got {value}")
    try:
        check_settings(args)
    except KVBoostError as exc:
        parser.error(str(exc))
    return args


def build_application(args: argparse.Namespace) -> Any:
    """The Ray Serve application the flags describe: an ingress over ``--replicas`` engine replicas."""
    from ray.serve.config import RequestRouterConfig

    from kvboost_hf.serve_ray.app import Ingress, KVBoostReplica

    options: dict[str, Any] = {
        "num_replicas": args.replicas,
        "max_ongoing_requests": args.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus},
        "graceful_shutdown_wait_loop_s": args.shutdown_wait_s,
    }
    router = ROUTER_CLASSES[args.routing]
    if router is not None:
        kwargs = {"imbalance_threshold": args.imbalance_threshold, "fallback": args.fallback}
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=router,  # type: ignore[arg-type]  # a class path, which Ray accepts
            request_router_kwargs=kwargs if args.routing == "prefix" else {},
        )
    replicas = as_deployment(KVBoostReplica).options(**options).bind(args)
    ingress = as_deployment(Ingress).options(
        ray_actor_options={"num_cpus": 0}, graceful_shutdown_wait_loop_s=args.shutdown_wait_s
    )
    return ingress.bind(replicas, server_settings(args), max_attempts=args.max_attempts)


def as_deployment(cls: type) -> Deployment:
    """``serve.deployment(cls)`` (typed: its overloads read a class as the decorator-factory form)."""
    from ray import serve

    return cast("Deployment", serve.deployment(cls))


def start(args: argparse.Namespace) -> str:
    """Start (or join) Ray, Ray Serve's HTTP proxy on ``--host``/``--port`` and the application; returns its URL."""
    import ray
    from ray import serve

    host = args.host or LOOPBACK
    warn_if_open(host, args.api_key)
    if not ray.is_initialized():
        if args.address is None:
            init_local_ray(args.num_cpus)
        else:
            ray.init(address=args.address)
    serve.start(http_options={"host": host, "port": args.port})
    serve.run(build_application(args), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{args.port}"


def init_local_ray(num_cpus: int | None, **kwargs: Any) -> None:
    """Start a local Ray without its dashboard (whose HTTP job API runs arbitrary code). Ray allows no more: it
    refuses a loopback node address (``ray.init(_node_ip_address="127.0.0.1")`` is replaced by the host's address)
    and binds its gRPC servers (GCS, raylet, workers) and agents on every interface; docs/server.md lists what
    stays open and how to firewall it. ``kwargs``: more ``ray.init`` options."""
    import ray

    ray.init(num_cpus=num_cpus, include_dashboard=False, **kwargs)


def main(argv: list[str] | None = None) -> int:
    from ray import serve

    args = parse_args(argv)
    configure_process(args)
    url = start(args)
    logger.info("serving on %s with %d replicas, %s routing", url, args.replicas, args.routing)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()  # replicas shut their workers down and close their stores
    return 0
