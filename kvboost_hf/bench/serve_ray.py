"""``python -m kvboost_hf.bench serve_ray``: the serve benchmark's chat users against replicas on Ray Serve.

One run, one local Ray instance, ``--replicas`` replicas of the embedded model (CPU processes), the same users and
flags in every scenario: round-robin vs prefix-aware (chunk-key) routing, each without and with the shared Redis tier,
then prefix routing with Redis while one replica is killed after ``--kill-after`` completed turns (the ingress sends
the lost requests again; Ray Serve replaces the replica after a failed health check). Each scenario is a fresh
application with empty RAM tiers and its own Redis key prefix; nothing is warmed. By default each user's
conversation starts with its own reference text (``--system-prompts per_user``: tenants or sessions with their own
documents), so a turn that reaches a replica that never saw its conversation recomputes it; ``shared`` gives every
user the serve benchmark's one system prompt, which every replica soon holds whatever the routing.

Measured with the official ``openai`` client (streaming, greedy, no client retries): TTFT p50/p99 (ms), reuse ratio
(cached / prompt tokens; also over the turns after the first, and how many of those another replica served), failed
requests (errors) and wrong answers (greedy text different from one engine's ``generate`` on the same conversation,
computed before Ray starts: :func:`reference_answers`). Output: a table, ``serve_ray.json`` and ``serve_ray.png``
under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvboost_hf.bench.common import pyplot
from kvboost_hf.bench.serve import (
    RequestRecord,
    add_load_arguments,
    check_load,
    free_port,
    run_users,
    server_flags,
    summarize,
    system_prompt,
    user_message,
)

logger = logging.getLogger(__name__)
DOCUMENTS_APART = 5  # per-user system prompts start this many corpus documents apart
# (name, routing, Redis tier, kill a replica)
SCENARIOS = (
    ("round_robin", "round_robin", False, False),
    ("prefix", "prefix", False, False),
    ("round_robin+redis", "round_robin", True, False),
    ("prefix+redis", "prefix", True, False),
    ("prefix+redis+kill", "prefix", True, True),
)


def system_prompts(args: argparse.Namespace) -> list[str]:
    """Each user's system prompt (``--system-prompts``): one shared text, or texts starting at other documents, each
    cut to ``--system-chars`` characters (so every user's prompt is as long)."""
    firsts = [DOCUMENTS_APART * user if args.system_prompts == "per_user" else 0 for user in range(args.users)]
    return [system_prompt(args.system_chars, first)[: args.system_chars] for first in firsts]


def reference_answers(args: argparse.Namespace, systems: list[str]) -> dict[tuple[int, int], str]:
    """(user, turn) -> the greedy answer of one engine to that turn of that user's conversation, with exact prefix
    reuse (what one server answers with its default ``--reuse-mode prefix_cache``, equal to no reuse; and cheaper)."""
    import torch

    from kvboost_hf import KVBoost

    if args.threads:  # as many as each replica: more threads than free cores spin on a contended CPU
        torch.set_num_threads(args.threads)
    engine = KVBoost.from_pretrained(chunking=args.chunk_size, device="cpu")
    answers = {}
    for user in range(args.users):
        messages = [{"role": "system", "content": systems[user]}]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": user_message(user, turn)})
            result = engine.generate(messages, args.max_tokens, mode="prefix_cache", temperature=0)
            answers[user, turn] = result.output_text
            messages.append({"role": "assistant", "content": answers[user, turn]})
    return answers


def run_scenario(
    routing: str, redis: bool, kill: bool, args: argparse.Namespace, port: int, systems: list[str]
) -> tuple[list[RequestRecord], float, str | None]:
    """Deploy, run the users, delete the application; returns the records, the wall time and the killed replica."""
    from ray import serve

    from kvboost_hf.serve_ray.app import kill_replica
    from kvboost_hf.serve_ray.launch import APP_NAME, parse_args, start

    flags = [*server_flags(args), "--replicas", str(args.replicas), "--routing", routing, "--port", str(port)]
    flags += ["--replica-cpus", str(args.replica_cpus), "--log-level", "warning"]
    if redis:
        flags += ["--remote-url", args.redis_url, "--remote-prefix", f"bench-{uuid.uuid4().hex[:12]}:"]
    url = start(parse_args(flags))
    killed: list[str] = []
    done = 0
    lock = threading.Lock()

    def on_record(record: RequestRecord) -> None:
        nonlocal done
        with lock:
            done += 1
            if kill and done == args.kill_after:
                killed.append(kill_replica(APP_NAME))
                logger.info("killed replica %s after %d turns", killed[0], done)

    try:
        records, wall_s = run_users(url, args, systems, on_record)
    finally:
        serve.delete(APP_NAME)
    return records, wall_s, killed[0] if killed else None


def follow_ups(records: list[RequestRecord]) -> dict[str, Any]:
    """What routing changes: the reuse ratio of turns after the first (the first has nothing to reuse) and how many
    of them a replica other than the previous turn's served (x-kvboost-replica: where the answer started)."""
    by_turn = {(r.user, r.turn): r for r in records}
    later = [r for r in records if r.turn > 0 and r.error is None]
    prompt = sum(r.prompt_tokens for r in later)
    moved = [r for r in later if (previous := by_turn.get((r.user, r.turn - 1))) and previous.replica != r.replica]
    return {
        "follow_up_turns": len(later),
        "follow_up_reuse_ratio": sum(r.cached_tokens for r in later) / prompt if prompt else 0.0,
        "moved_turns": len(moved),
    }


def plot(runs: dict, path: Path) -> None:
    plt = pyplot()
    names = list(runs)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    xs = range(len(names))
    for offset, key, label in ((-0.2, "ttft_p50_ms", "p50"), (0.2, "ttft_p99_ms", "p99")):
        axes[0].bar([x + offset for x in xs], [runs[n]["summary"][key] for n in names], width=0.4, label=label)
    axes[0].set_title("TTFT (ms)")
    axes[0].legend()
    axes[1].bar(list(xs), [runs[n]["summary"]["reuse_ratio"] for n in names])
    axes[1].set_title("reuse ratio (cached / prompt tokens)")
    for ax in axes:
        ax.set_xticks(list(xs), names, rotation=20, ha="right")
    fig.suptitle("kvboost_hf on Ray Serve: replicas, routing and the Redis tier (same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare_routings(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Prefix vs round-robin routing, without and with Redis: reuse-ratio gain and TTFT p50 speed-up, and whether
    the issue's targets (>= 1.5x reuse, lower TTFT p50, RAM only) are met."""
    comparison: dict[str, Any] = {}
    for tier in ("", "+redis"):
        rr, prefix = runs[f"round_robin{tier}"]["summary"], runs[f"prefix{tier}"]["summary"]
        comparison[f"reuse_gain{tier}"] = prefix["reuse_ratio"] / rr["reuse_ratio"] if rr["reuse_ratio"] else None
        comparison[f"ttft_p50_speedup{tier}"] = rr["ttft_p50_ms"] / prefix["ttft_p50_ms"]
    comparison["targets_met"] = (comparison["reuse_gain"] or 0) >= 1.5 and comparison["ttft_p50_speedup"] > 1
    return comparison


def print_report(runs: dict[str, dict[str, Any]], comparison: dict[str, Any]) -> None:
    """One line per scenario, then the routing comparison."""
    header = f"{'scenario':<20}{'reqs':>5}{'failed':>7}{'wrong':>6}{'TTFT p50':>10}{'p99':>8}{'reuse':>7}"
    print(f"{header}{'later turns':>13}{'moved':>7}  replicas")
    for name, run in runs.items():
        s = run["summary"]
        print(
            f"{name:<20}{s['requests']:>5}{s['errors']:>7}{s['wrong']:>6}{s['ttft_p50_ms']:>10.0f}"
            f"{s['ttft_p99_ms']:>8.0f}{s['reuse_ratio']:>7.2f}{s['follow_up_reuse_ratio']:>13.2f}"
            f"{s['moved_turns']:>7}  {len(s['replicas_used'])}"
        )
    for tier in ("", "+redis"):
        gain = comparison[f"reuse_gain{tier}"]
        print(
            f"prefix vs round-robin{tier or ' (RAM only)'}: reuse ratio {gain:.2f}x, "
            f"TTFT p50 {comparison[f'ttft_p50_speedup{tier}']:.2f}x lower"
            if gain is not None
            else f"prefix vs round-robin{tier}: round-robin reused nothing"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvboost_hf.bench serve_ray", description=__doc__.splitlines()[0])
    add_load_arguments(parser, users=3, turns=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica-cpus", type=float, default=0.5, help="CPUs Ray reserves per replica")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the shared tier (.ci/start-redis.sh)")
    parser.add_argument("--system-prompts", choices=("per_user", "shared"), default="per_user")
    parser.add_argument("--kill-after", type=int, default=None, help="completed turns before the kill (default: users)")
    parser.set_defaults(system_chars=1500)  # three distinct prompts: shorter than the serve benchmark's shared one
    args = parser.parse_args(argv)
    check_load(parser, args)
    args.kill_after = args.kill_after or args.users
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    import ray

    systems = system_prompts(args)
    logger.info("reference answers: one engine, greedy, %d users x %d turns", args.users, args.turns)
    reference = reference_answers(args, systems)
    ray.init(include_dashboard=False, log_to_driver=False)
    runs: dict[str, dict[str, Any]] = {}
    port = free_port()
    try:
        for name, routing, redis, kill in SCENARIOS:
            logger.info("scenario %s: %d users x %d turns, %d replicas", name, args.users, args.turns, args.replicas)
            records, wall_s, killed = run_scenario(routing, redis, kill, args, port, systems)
            wrong = [r for r in records if r.error is None and r.answer != reference[r.user, r.turn]]
            summary: dict[str, Any] = {"routing": routing, "redis": redis, "killed": killed}
            summary |= summarize(records, wall_s) | follow_ups(records)
            summary["wrong"] = len(wrong)
            summary["replicas_used"] = sorted({r.replica for r in records if r.replica})
            runs[name] = {"summary": summary, "records": [asdict(r) for r in records]}
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    comparison = compare_routings(runs)
    print_report(runs, comparison)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    payload = {"config": config, "cpu_count": os.cpu_count(), "comparison": comparison, **runs}
    (args.out / "serve_ray.json").write_text(json.dumps(payload, indent=2))
    plot(runs, args.out / "serve_ray.png")
    print(f"wrote {args.out / 'serve_ray.json'} and {args.out / 'serve_ray.png'}")
    failed = sum(run["summary"]["errors"] + run["summary"]["wrong"] for run in runs.values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
