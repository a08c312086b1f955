"""``python -m kvboost_hf.bench serve``: simulated chat users against the server with reuse off, then on.

Each of ``--users`` users holds a ``--turns``-turn conversation that starts with one shared system prompt
(real text from :mod:`kvboost_hf.corpus`); the next turn is sent as soon as the previous answer is complete.
Both servers run the same build and flags on loopback (``--reuse-mode baseline``, then ``prefix_cache``), each in
its own process started and stopped by this script; nothing is warmed before the timed requests.

Measured per request with the official ``openai`` client (streaming, ``include_usage``): TTFT (call to first
content chunk, ms), inter-token latency (gaps between content chunks, ms), prompt and cached tokens, errors.
Throughput is completed requests per second of the run's wall time. Output: a table, ``serve.json`` and
``serve.png`` under ``--out``. Bounded: ``--users`` x ``--turns`` requests, each with ``--max-tokens`` tokens,
and every run stops starting turns after ``--time-limit-s`` seconds.

``--join`` measures chunked prefill instead: ``--join-rows`` rows stream greedy answers (end tokens ignored) and a
prompt of about 4k tokens joins them, once against a server without a token budget (its prefill is one forward:
the running rows wait for all of it), once with ``--token-budget`` ``--join-budget`` and ``--no-pack-forwards``
(decode steps first, the prompt in chunks between them, each a forward of its own) and once with that budget and
packed forwards (the server's default: the decode steps and the chunk in one forward where the attention allows).
Per arm: the join's TTFT and the running rows' worst inter-token gap during the join against their median gap
outside it (target: at most 3x); the rows' answers must be equal in every arm.
Output: a table and ``serve_join.json`` under ``--out``.

The servers load the embedded model, ``--model DIR`` (a local model folder), or ``--random-shape NAME``: random
weights of a real shape written to a temporary folder first (timings only; its vocabulary is cut to the
tokenizer's so every generated id decodes to text).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from kvboost_hf.bench.common import pyplot
from kvboost_hf.corpus import documents
from kvboost_hf.server.launch import add_forward_arguments, freeze_startup_heap
from kvboost_hf.server.settings import EMBEDDED_MODEL_NAME

if TYPE_CHECKING:  # openai is an optional dependency, imported where it is used
    import openai
    from openai.types.chat import ChatCompletionMessageParam

logger = logging.getLogger(__name__)
MODEL = EMBEDDED_MODEL_NAME
QUESTIONS = (
    "Summarise the first paragraph in one sentence.",
    "Which function would you use first, and why?",
    "Give one pitfall a beginner might hit.",
    "How would you test code that uses it?",
    "Name a related module.",
    "What changed in recent Python versions?",
)


@dataclass
class RequestRecord:
    """One chat turn as the client saw it (times in milliseconds)."""

    user: int
    turn: int
    ttft_ms: float | None = None
    total_ms: float = 0.0
    gaps_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    answer: str = ""
    replica: str | None = None  # the x-kvboost-replica header (replicas on Ray Serve), None from one server


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def system_prompt(min_chars: int, first_document: int = 0) -> str:
    """A system prompt of at least ``min_chars`` characters of real documentation text, from the corpus's
    ``first_document`` on (different values give different prompts)."""
    text = "You are a documentation assistant. Answer briefly, using only this reference:\n\n"
    corpus = documents()
    for title, body in corpus[first_document:] + corpus[:first_document]:
        if len(text) >= min_chars:
            break
        text += f"## {title}\n{body}\n\n"
    return text


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """``python -m kvboost_hf.server`` on a free loopback port; stopped with SIGINT (graceful)."""

    def __init__(
        self, extra: list[str], startup_timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kvboost_hf.server", "--host", "127.0.0.1", "--port", str(self.port)]
        self.process = subprocess.Popen([*command, *extra, "--log-level", "warning"], env=env, cwd=cwd)
        deadline = time.monotonic() + startup_timeout_s
        # one client for the polls: each httpx.get builds a client whose SSL context loads the CA bundle (~0.1-0.25 s
        # of CPU, 4 times a second), CPU taken from the server starting beside it
        with httpx.Client(timeout=2) as client:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"server exited with {self.process.returncode}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError("server did not start")
                time.sleep(0.25)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def user_message(user: int, turn: int) -> str:
    """What user ``user`` sends at turn ``turn``."""
    return f"(user {user}) {QUESTIONS[(user + turn) % len(QUESTIONS)]}"


@dataclass
class Streamed:
    """One streamed chat completion as the client saw it: when it was sent and when each content chunk arrived
    (``time.perf_counter()`` values), the answer, the usage figures and the replica header."""

    started: float
    times: list[float] = field(default_factory=list)
    answer: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica: str | None = None


def stream_chat(
    client: openai.OpenAI,
    messages: list[ChatCompletionMessageParam],
    max_tokens: int,
    streamed: Streamed,
    extra_body: dict[str, object] | None = None,
) -> Streamed:
    """Stream one greedy chat completion into ``streamed`` (filled as chunks arrive, so another thread may watch its
    ``times``); returns it."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra_body,
    )
    streamed.replica = raw.headers.get("x-kvboost-replica")
    for chunk in raw.parse():
        now = time.perf_counter()
        if chunk.usage is not None:
            streamed.prompt_tokens = chunk.usage.prompt_tokens
            streamed.completion_tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            streamed.cached_tokens = (details.cached_tokens or 0) if details else 0
        if chunk.choices and chunk.choices[0].delta.content:
            streamed.answer += chunk.choices[0].delta.content
            streamed.times.append(now)
    return streamed


def run_user(
    url: str,
    user: int,
    args: argparse.Namespace,
    system: str,
    deadline: float,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """One user's conversation; returns a record per turn sent (each also given to ``on_record`` when complete)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=args.request_timeout_s)
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": system}]
    records = []
    for turn in range(args.turns):
        if time.monotonic() > deadline:
            break
        messages.append({"role": "user", "content": user_message(user, turn)})
        record = RequestRecord(user, turn)
        streamed = Streamed(time.perf_counter())
        try:
            stream_chat(client, messages, args.max_tokens, streamed)
        except Exception as exc:  # counted as an error of the run, the user goes on
            record.error = f"{type(exc).__name__}: {exc}"
        times = streamed.times
        record.ttft_ms = (times[0] - streamed.started) * 1e3 if times else None
        record.gaps_ms = [(later - earlier) * 1e3 for earlier, later in itertools.pairwise(times)]
        record.prompt_tokens, record.cached_tokens = streamed.prompt_tokens, streamed.cached_tokens
        record.completion_tokens, record.replica = streamed.completion_tokens, streamed.replica
        record.total_ms = (time.perf_counter() - streamed.started) * 1e3
        record.answer = streamed.answer
        records.append(record)
        if on_record is not None:
            on_record(record)
        messages.append({"role": "assistant", "content": record.answer})
    return records


def run_mode(reuse: bool, args: argparse.Namespace, system: str, model_flags: Sequence[str] = ()) -> dict:
    """Start a server (``model_flags``: which model it loads; none: the embedded model), run every user
    concurrently, stop the server; returns the summary and the records."""
    flags = [*server_flags(args), *model_flags, "--reuse-mode", "prefix_cache" if reuse else "baseline"]
    server = ServerProcess(flags, args.startup_timeout_s)
    try:
        records, wall_s = run_users(server.url, args, [system] * args.users)
    finally:
        server.stop()
    return {"summary": {"reuse": reuse, **summarize(records, wall_s)}, "records": [asdict(r) for r in records]}


def server_flags(args: argparse.Namespace) -> list[str]:
    """The server flags every benchmarked server gets (chunking, batching, queue, threads, packed forwards off, graphs
    on or off and the attention when asked). The grammar compile
    processes start on first use (no benchmarked request is structured): started with the server, their imports
    would take CPU from the first measured turns."""
    flags = ["--chunk-size", str(args.chunk_size), "--batch-window-ms", str(args.batch_window_ms)]
    flags += ["--no-start-with-server"]
    flags += ["--max-batch-size", str(args.max_batch_size), "--max-queue", str(4 * args.users)]
    if args.threads:  # 0: torch's default
        flags += ["--threads", str(args.threads)]
    if not args.pack_forwards:
        flags += ["--no-pack-forwards"]
    if args.graphs is not None:
        flags += ["--graphs" if args.graphs else "--no-graphs"]
    if args.attn_implementation is not None:
        flags += ["--attn-implementation", args.attn_implementation]
    return flags


def run_users(
    url: str,
    args: argparse.Namespace,
    systems: Sequence[str],
    on_record: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Every user's conversation at once against ``url`` (user ``i`` after ``systems[i]``); returns the records
    and the wall time (s)."""
    results: list[list[RequestRecord]] = [[] for _ in range(args.users)]
    started = time.perf_counter()
    deadline = time.monotonic() + args.time_limit_s

    def user(index: int) -> None:
        results[index] = run_user(url, index, args, systems[index], deadline, on_record)

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(args.users)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(args.time_limit_s + 2 * args.request_timeout_s)
    return [r for rs in results for r in rs], time.perf_counter() - started


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    """Counts, TTFT and inter-token latency percentiles (ms), throughput and the share of prompt tokens reused."""
    ok = [r for r in records if r.error is None and r.ttft_ms is not None]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    gaps = [g for r in ok for g in r.gaps_ms]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "wall_s": wall_s,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p99_ms": percentile(gaps, 99),
        "throughput_rps": len(ok) / wall_s,
        "reuse_ratio": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "mean_prompt_tokens": prompt / len(ok) if ok else 0.0,
    }


def join_gaps(streams: Sequence[Sequence[float]], start: float, end: float) -> dict[str, float]:
    """The running rows' inter-token gaps around a join sent at ``start`` whose first token came at ``end``
    (``time.perf_counter()`` values; ``streams``: each row's content chunk times): ``median_ms``, the median of the
    gaps wholly before or after ``[start, end]`` (steady decoding); ``worst_ms`` and ``join_p50_ms``, the largest
    and the median of the gaps that overlap it; ``ratio`` = worst / median (NaN where a side has no gap);
    ``joined_ms``, the largest gap holding ``end`` (the step that completed the join's prefill and added its row to
    the batch, or the next one where that step's tokens of a row reached the client before the join's) and
    ``chunks_worst_ms``, the largest of the others overlapping the join (steps of its chunks); ``join_p90_ms``, the
    90th percentile of the gaps overlapping it, and ``steady_worst_ms``, the largest gap outside it (the harness's
    own noise: a gap can widen without a join, e.g. while the client or the server's event loop waits for a core)."""
    outside: list[float] = []
    chunks: list[float] = []
    joined: list[float] = []
    for times in streams:
        for earlier, later in itertools.pairwise(times):
            gap = (later - earlier) * 1e3
            if earlier < end <= later:
                joined.append(gap)
            elif later > start and earlier < end:
                chunks.append(gap)
            else:
                outside.append(gap)
    during = chunks + joined
    median = statistics.median(outside) if outside else float("nan")
    worst = max(during, default=float("nan"))
    return {
        "median_ms": median,
        "worst_ms": worst,
        "join_p50_ms": statistics.median(during) if during else float("nan"),
        "join_p90_ms": statistics.quantiles(during, n=10, method="inclusive")[-1] if len(during) > 1 else worst,
        "steady_worst_ms": max(outside, default=float("nan")),
        "ratio": worst / median,
        "gaps_during_join": len(during),
        "joined_ms": max(joined, default=float("nan")),
        "chunks_worst_ms": max(chunks, default=float("nan")),
    }


def run_join(
    budget: int,
    args: argparse.Namespace,
    model_flags: Sequence[str] = (),
    bias: dict[str, int] | None = None,
    *,
    pack: bool = True,
) -> dict:
    """Start a server with token budget ``budget`` (0: none) and packed forwards on or off (``pack``), stream
    ``--join-rows`` greedy answers of ``--join-stream-tokens`` tokens (end tokens ignored), and once each streamed
    ``--join-after-tokens`` send a prompt of about ``--join-chars`` characters of documentation (four tokens to the
    character or so); returns the join's prompt tokens and TTFT, the running rows' gaps around it
    (:func:`join_gaps`), whether every row was still streaming when the join's first token came (``covered``) and
    the rows' answers. ``bias``: the rows' ``logit_bias`` (:func:`special_token_bias`)."""
    import openai

    # argparse keeps the last of a repeated flag: room for the running rows and the join
    flags = [*server_flags(args), *model_flags, "--max-batch-size", str(args.join_rows + 1)]
    packing = "--pack-forwards" if pack else "--no-pack-forwards"
    server = ServerProcess([*flags, "--token-budget", str(budget), packing], args.startup_timeout_s)
    errors: list[BaseException] = []
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                               timeout=args.request_timeout_s)  # fmt: skip
        running = [Streamed(time.perf_counter()) for _ in range(args.join_rows)]
        freeze_startup_heap()  # this process's own collections would stall the 8 rows' receipt, as the server's do

        def stream(index: int) -> None:
            try:
                message: ChatCompletionMessageParam = {"role": "user", "content": user_message(index, 0)}
                extra = {"ignore_eos": True, "logit_bias": bias or {}}
                stream_chat(client, [message], args.join_stream_tokens, running[index], extra)
            except Exception as error:  # reported after the run
                errors.append(error)

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(args.join_rows)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + args.request_timeout_s
        while any(len(row.times) < args.join_after_tokens for row in running) and not errors:
            if time.monotonic() > deadline:
                raise TimeoutError("the running rows did not start streaming")
            time.sleep(0.01)
        join = Streamed(time.perf_counter())
        document: ChatCompletionMessageParam = {"role": "system", "content": system_prompt(args.join_chars, 3)}
        question: ChatCompletionMessageParam = {"role": "user", "content": QUESTIONS[0]}
        stream_chat(client, [document, question], 4, join, {"ignore_eos": True})
        for thread in threads:
            thread.join(args.request_timeout_s)
    finally:
        server.stop()
    if errors:
        raise errors[0]
    end = join.times[0]
    return {
        "token_budget": budget,
        "pack_forwards": pack,
        "join_prompt_tokens": join.prompt_tokens,
        "join_ttft_ms": (end - join.started) * 1e3,
        **join_gaps([row.times for row in running], join.started, end),
        "covered": all(row.times[-1] > end for row in running),
        "answers": [row.answer for row in running],
    }


def special_token_bias(folder: str | None) -> dict[str, int]:
    """A ``logit_bias`` banning the special tokens of the tokenizer in ``folder`` (None: the embedded model's). The
    join's rows stream past their end token (``ignore_eos``); a special token (a chat template's turn markers) has
    no text, so its step sends no chunk and the client would see a gap of two or three steps that no step made."""
    from transformers import AutoTokenizer

    from kvboost_hf.hf.models import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(folder if folder is not None else embedded_model_dir())
    return {str(token): -100 for token in tokenizer.all_special_ids}


def join_main(args: argparse.Namespace, model_flags: Sequence[str], bias: dict[str, int]) -> int:
    """``--join``: the running rows' gaps while a long prompt joins, without a token budget, with ``--join-budget``
    and a forward per batch step and chunk (``unpacked``), and with that budget and packed forwards (``after``), in
    one run (``bias``: the rows' ``logit_bias``, :func:`special_token_bias`); prints a table and writes
    ``serve_join.json``. Exit status 0 when every arm ran and the rows streamed through the join with the same
    answers."""
    arms = {}
    for name, budget, pack in (("before", 0, True), ("unpacked", args.join_budget, False),
                               ("after", args.join_budget, True)):  # fmt: skip
        logger.info("%s: %d streaming rows, a long prompt joins (token budget %d, packed forwards %s)", name,
                    args.join_rows, budget, pack)  # fmt: skip
        arms[name] = run_join(budget, args, model_flags, bias, pack=pack)
    print(
        f"{'arm':<9}{'budget':>7}{'packed':>7}{'prompt':>7}{'join TTFT':>10}{'median':>8}{'worst':>8}{'join p50':>9}"
        f"{'join p90':>9}{'chunks':>8}{'joined':>8}{'ratio':>7}{'steady worst':>13}"
    )
    for name, arm in arms.items():
        print(
            f"{name:<9}{arm['token_budget']:>7}{'yes' if arm['pack_forwards'] else 'no':>7}"
            f"{arm['join_prompt_tokens']:>7}{arm['join_ttft_ms']:>10.0f}"
            f"{arm['median_ms']:>8.0f}{arm['worst_ms']:>8.0f}{arm['join_p50_ms']:>9.0f}{arm['join_p90_ms']:>9.0f}"
            f"{arm['chunks_worst_ms']:>8.0f}{arm['joined_ms']:>8.0f}{arm['ratio']:>7.1f}{arm['steady_worst_ms']:>13.0f}"
        )
    same = all(arm["answers"] == arms["before"]["answers"] for arm in arms.values())
    covered = all(arm["covered"] for arm in arms.values())
    print(
        f"running rows' worst gap during the join: {arms['before']['ratio']:.1f}x their median without a budget, "
        f"{arms['unpacked']['ratio']:.1f}x with {args.join_budget} tokens per step in forwards of their own, "
        f"{arms['after']['ratio']:.1f}x packed (target <= 3x); answers equal: {same}; rows streamed through the "
        f"join: {covered}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    payload = {"config": config, "cpu_count": os.cpu_count(), "answers_equal": same, **arms}
    (args.out / "serve_join.json").write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out / 'serve_join.json'}")
    return 0 if same and covered else 1


def plot(off: dict, on: dict, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    panels = [
        ("TTFT (ms)", ["ttft_p50_ms", "ttft_p99_ms"], ["p50", "p99"]),
        ("inter-token latency (ms)", ["itl_p50_ms", "itl_p99_ms"], ["p50", "p99"]),
        ("throughput (requests/s)", ["throughput_rps"], ["req/s"]),
    ]
    for ax, (title, keys, labels) in zip(axes, panels, strict=True):
        xs = range(len(keys))
        ax.bar([x - 0.2 for x in xs], [off[k] for k in keys], width=0.4, label="reuse off")
        ax.bar([x + 0.2 for x in xs], [on[k] for k in keys], width=0.4, label="reuse on")
        ax.set_xticks(list(xs), labels)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("kvboost_hf server: simulated multi-turn chat users, reuse off vs on (same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_load_arguments(parser: argparse.ArgumentParser, users: int, turns: int) -> None:
    """The simulated users' flags (``users`` and ``turns``: their defaults) and the servers' shared flags."""
    parser.add_argument("--users", type=int, default=users)
    parser.add_argument("--turns", type=int, default=turns)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--system-chars", type=int, default=2500, help="length of the shared system prompt")
    parser.add_argument("--chunk-size", type=int, default=32, help="short chat turns suit small chunks")
    parser.add_argument("--batch-window-ms", type=float, default=20.0)
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of each server (1: stable timings on a shared CPU)"
    )
    parser.add_argument(
        "--pack-forwards",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the servers' packed forwards (off: a forward per batch step and per prompt; the server's own flag)",
    )
    add_forward_arguments(parser.add_argument_group("the servers' forwards (passed on to them)"))
    parser.add_argument("--time-limit-s", type=float, default=120.0, help="per run: no new turn after this")
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--startup-timeout-s", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))


def check_load(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not (1 <= args.users <= 32 and 1 <= args.turns <= 16 and 1 <= args.max_tokens <= 256):
        parser.error("keep the load bounded: users <= 32, turns <= 16, max-tokens <= 256")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvboost_hf.bench serve", description=__doc__.splitlines()[0])
    add_load_arguments(parser, users=4, turns=4)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", help="local model folder the servers load (default: the embedded model)")
    model.add_argument("--random-shape", help="random weights of this shape (a kvboost_hf.bench.shapes name)")
    join = parser.add_argument_group("join: a long prompt joining streaming rows, without and with a token budget")
    join.add_argument("--join", action="store_true", help="run this measurement instead of the chat users")
    join.add_argument("--join-rows", type=int, default=8, help="rows streaming when the prompt joins")
    join.add_argument("--join-chars", type=int, default=16_000, help="the joining prompt's characters (~4k tokens)")
    join.add_argument("--join-budget", type=int, default=24, help="the token budget of the second arm")
    join.add_argument("--join-stream-tokens", type=int, default=512, help="tokens each running row streams")
    join.add_argument("--join-after-tokens", type=int, default=16, help="tokens each row streamed before the join")
    args = parser.parse_args(argv)
    check_load(parser, args)
    if args.join and not (1 <= args.join_rows <= 32 and args.join_after_tokens < args.join_stream_tokens <= 2048):
        parser.error("keep the join bounded: join-rows <= 32, join-after-tokens < join-stream-tokens <= 2048")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # no per-request lines from httpx
    logger.setLevel(logging.INFO)
    system = system_prompt(args.system_chars)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="kvboost-serve-") as scratch:
        folder = args.model
        if args.random_shape is not None:
            from kvboost_hf.bench.shapes import save_random_model

            folder = str(save_random_model(args.random_shape, Path(scratch) / args.random_shape))
        model_flags = ["--model", folder, "--served-model-name", MODEL] if folder is not None else []
        if args.join:
            return join_main(args, model_flags, special_token_bias(folder))
        for reuse in (False, True):
            logger.info("running %d users x %d turns with reuse %s", args.users, args.turns, "on" if reuse else "off")
            runs["on" if reuse else "off"] = run_mode(reuse, args, system, model_flags)
    off, on = runs["off"]["summary"], runs["on"]["summary"]
    comparison = {
        "ttft_p50_speedup": off["ttft_p50_ms"] / on["ttft_p50_ms"],
        "ttft_p99_speedup": off["ttft_p99_ms"] / on["ttft_p99_ms"],
        "throughput_gain": on["throughput_rps"] / off["throughput_rps"],
        "targets_met": off["ttft_p50_ms"] >= 5 * on["ttft_p50_ms"]
        and on["throughput_rps"] >= 2 * off["throughput_rps"],
    }
    header = (
        f"{'reuse':<6}{'reqs':>6}{'err':>5}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>8}{'req/s':>8}{'reuse':>7}"
    )
    print(header)
    for name, s in (("off", off), ("on", on)):
        print(
            f"{name:<6}{s['requests']:>6}{s['errors']:>5}{s['ttft_p50_ms']:>10.0f}{s['ttft_p99_ms']:>9.0f}"
            f"{s['itl_p50_ms']:>9.0f}{s['itl_p99_ms']:>8.0f}{s['throughput_rps']:>8.3f}{s['reuse_ratio']:>7.2f}"
        )
    print(
        f"TTFT p50 {comparison['ttft_p50_speedup']:.1f}x lower, p99 {comparison['ttft_p99_speedup']:.1f}x; "
        f"throughput {comparison['throughput_gain']:.2f}x (targets: 5x, 2x)"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    payload = {"config": config, "cpu_count": os.cpu_count(), "comparison": comparison, **runs}
    (args.out / "serve.json").write_text(json.dumps(payload, indent=2))
    plot(off, on, args.out / "serve.png")
    print(f"wrote {args.out / 'serve.json'} and {args.out / 'serve.png'}")
    return 0 if off["errors"] == 0 and on["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
