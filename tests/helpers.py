"""Helpers shared by several test modules (test modules never import each other; fixtures and the tiny models' configs
live in conftest.py, stored chunks and a tier defined outside the package in chunks.py).

Sections: subprocesses, a private redis-server, word-level prompts for the tiny models,
non-prefix reuse on tiny models, the decode loop on token ids, a live OpenAI-compatible server, statistics.
Optional dependencies (redis, uvicorn, openai, httpx, fastapi) are imported where they are used, so a module that
needs none of them imports this one without them.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from chunks import assert_same as assert_same
from chunks import flip_inside_record as flip_inside_record
from chunks import key as key
from chunks import make_entry as make_entry
from chunks import raw_entry as raw_entry
from conftest import greedy, make_tiny_model
from forkserver import ForkServer
from transformers import DynamicCache, PreTrainedTokenizerFast

from kvboost_hf import ChunkingConfig, ChunkReuseCache, ChunkStore, GenerationMode, RepairConfig, StoreConfig
from kvboost_hf.hf.decode import DecodeLoop, DecodeRow, DraftRound, PrefillWork, RowOutput
from kvboost_hf.scheduling import append_output, prefill_works

TESTS_DIR = Path(__file__).parent


# ---------------------------------------------------------------------------------------------- subprocesses
# A child Python sees the tests directory (conftest, helpers) and the repository, as the test process does.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(TESTS_DIR.parent), *sys.path])}


#: what :func:`python_child`'s fork server imports: the store and the store tests' chunks (torch, ~1.9 s of CPU here)
STORE_IMPORTS = ("torch", "kvboost_hf.store", "chunks")


@functools.cache
def _store_forks() -> ForkServer:
    """The fork server of :func:`python_child`, started on first use in this test process with :data:`ENV` and
    closed at its exit."""
    forks = ForkServer(ENV, imports=STORE_IMPORTS)
    atexit.register(forks.close)
    return forks


def python_child(
    code: str,
    *args: object,
    stdout: Any = subprocess.PIPE,
    stderr: Any = subprocess.PIPE,
    env: dict[str, str] | None = None,
) -> Any:
    """``python -c code args`` with ``env`` (default :data:`ENV`; read at run time only: the fork server imported
    with :data:`ENV`) in this process's working folder, forked from a process that imported :data:`STORE_IMPORTS`
    (tests/forkserver.py): a process of its own, as the store tests need (killed, stopped, sharing a directory),
    without paying the imports per child. ``stdout``/``stderr`` as ``subprocess.Popen`` takes them; pipes read as
    text. Returns a ``ForkedProcess``."""
    command = ["-c", code, *map(str, args)]
    return _store_forks().popen(command, stdout=stdout, stderr=stderr, env=env or ENV, text=True)


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a :func:`python_child`; its output captured as text; ``timeout`` in seconds (then killed)."""
    child = python_child(code, *args)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def generate_through_store(remote_url: str) -> dict[str, Any]:
    """The tiny Llama's greedy ``generate()`` of a fixed 70-token prompt through a ``ChunkReuseCache`` whose store has
    a Redis tier at ``remote_url`` (the store closed, so its writes have landed), and without the cache: the tokens
    of both, the prompt tokens the cache reused and the store's stats. Run by a test and by its child process."""
    model = make_tiny_model("llama")
    ids = torch.randint(1, 128, (1, 70), generator=torch.Generator().manual_seed(7))
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    store = ChunkStore(StoreConfig(1 << 26, remote_url=remote_url))
    cache = ChunkReuseCache(store, model, chunking=16)
    out = model.generate(ids, cache=cache, **options)
    store.close()
    return {
        "tokens": out[0].tolist(),
        "full_prefill": model.generate(ids, **options)[0].tolist(),
        "cached_tokens": cache.last_reuse[0].cached_tokens,
        "stats": store.stats(),
    }


def free_port() -> int:
    """A loopback TCP port free at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------- redis
@dataclass
class RedisServer:
    """A private redis-server on 127.0.0.1; ``stop``/``start`` simulate an outage on the same port. ``port`` 0:
    the first ``start`` picks a free one."""

    directory: Path
    password: str | None = None
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, tries: int = 5) -> None:
        """Start it and wait (at most 10 s a try) until this process answers. A port picked here that another
        process binds first (xdist workers start servers at the same time) is replaced by a new pick, ``tries``
        times at most; a port already set (a restart) is kept."""
        pick = self.port == 0
        for _ in range(tries if pick else 1):
            if pick:
                self.port = free_port()
            if self._launch():
                return
        log = self.directory / f"redis-{self.port}.log"
        raise RuntimeError(f"redis-server did not start: {log.read_text()[-2000:] if log.exists() else 'no log'}")

    def _launch(self) -> bool:
        """Start redis-server on :attr:`port`: True once it answers with its own process id, False if it exited
        (its port taken); another server already on the port answers with another id and is not taken for it."""
        import redis

        binary = shutil.which("redis-server")
        assert binary is not None
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.directory), "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"]
        args += ["--logfile", str(self.directory / f"redis-{self.port}.log")]
        if self.password:
            args += ["--requirepass", self.password]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, password=self.password, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while process.poll() is None:
            try:
                if client.info("server")["process_id"] == process.pid:
                    self.process = process
                    return True
            except (redis.ConnectionError, redis.AuthenticationError, redis.ResponseError):
                pass  # not listening yet, or another server (with another password) on the port
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise TimeoutError(f"redis-server on port {self.port} did not answer within 10 s")
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url)


# ---------------------------------------------------------------------------------------------- word prompts
VOCAB = 128  # the tiny models' vocabulary


def word_tokenizer(size: int = VOCAB) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer: ``<pad>`` = 0, ``<eos>`` = 1, ``w2 .. w{size-1}`` (the tiny models' vocab)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<pad>", eos_token="<eos>", pad_token="<pad>")


def words(seed: int, length: int) -> str:
    """``length`` random words; the third is the pad token (chat prompts hold special tokens too)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = [f"w{int(i)}" for i in torch.randint(2, VOCAB, (length,), generator=generator)]
    tokens[2] = "<pad>"
    return " ".join(tokens)


def scrape_metrics(engine: Any, prompt: str) -> tuple[dict, dict[str, float]]:
    """Generate 8 tokens of ``prompt``, then the engine's ``cache_stats()`` and its server's ``/metrics`` samples
    (metric name -> value)."""
    from fastapi.testclient import TestClient

    from kvboost_hf.server.app import ServerConfig, create_app

    engine.generate(prompt, max_new_tokens=8)
    stats = engine.cache_stats()
    with TestClient(create_app(engine, ServerConfig(model_name="tiny"))) as client:
        text = client.get("/metrics").text
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return stats, {name: float(value) for name, value in samples}


# ---------------------------------------------------------------------------------------------- non-prefix reuse
REPAIR_CHUNK = 16  # tokens per chunk of the non-prefix reuse tests


def documents(count: int = 3, length: int = 40, seed: int = 0) -> list[torch.Tensor]:
    """``count`` random token documents of ``length`` ids in ``[1, 128)``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (length,), generator=gen) for _ in range(count)]


def warm_alone(model, store, doc: torch.Tensor, **kwargs) -> None:
    """Prefill ``doc`` alone as one segment and store its chunks."""
    cache = ChunkReuseCache(store, model, chunking=REPAIR_CHUNK, segment_starts=[0, len(doc)], **kwargs)
    model(doc[None], cache=cache, use_cache=True, logits_to_keep=1)
    cache.save()


def run(
    model,
    store,
    ids,
    starts=(),
    new=8,
    chunking=REPAIR_CHUNK,
    mode=GenerationMode.CHUNK_KV_REUSE,
    write_back=True,
    **repair,
):
    """Greedy ``generate()`` of ``new`` tokens on a chunk-reuse cache with segment ``starts`` and ``repair``
    settings: ``((sequences, logits), cache)``."""
    cache = ChunkReuseCache(
        store, model, chunking, RepairConfig(**repair), mode=mode, segment_starts=starts, write_back=write_back
    )
    return greedy(model, ids, cache, new), cache


def full_prefill(model, ids) -> DynamicCache:
    """The K/V of a plain prefill of ``ids``."""
    cache = DynamicCache()
    model(ids, cache=cache)
    return cache


def shuffled_prompt(docs, order, question):
    """``docs`` in ``order`` then ``question`` as one ``[1, L]`` prompt, and each part's start."""
    parts = [docs[i] for i in order] + [question]
    starts = [sum(len(p) for p in parts[:i]) for i in range(len(parts))]
    return torch.cat(parts)[None], starts


# ---------------------------------------------------------------------------------------------- decode loop
DECODE_CHUNKING = ChunkingConfig(8)
DECODE_EOS = {127}


def as_text(tokens: list[int]) -> str:
    """Token ids as text (``<7><12>``), the decode loop's tokenizer-free decode."""
    return "".join(f"<{t}>" for t in tokens)


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it is handed and runs each as traced (no code
    generation, like backend ``"eager"``)."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        self.compiles += 1
        return graph_module.forward


def reuse_caches(store: ChunkStore | None, model, **options) -> Callable[[tuple[int, ...]], ChunkReuseCache] | None:
    """A loop's cache factory: chunk-reuse caches on ``store`` built for the rows' segment starts (None: plain K/V),
    in the engine's default mode (``chunk_kv_reuse``, as :meth:`Factories.new_cache` builds them) unless given."""
    if store is None:
        return None
    options = {"mode": GenerationMode.CHUNK_KV_REUSE, **options}
    return lambda starts: ChunkReuseCache(store, model, DECODE_CHUNKING, segment_starts=starts, **options)


class AppliedLoop(DecodeLoop):
    """A decode loop driven without a scheduler: :meth:`add` and :meth:`step` also append the sampled tokens to the
    rows and end them as the scheduler does (:func:`~kvboost_hf.scheduling.append_output`, text from
    :func:`as_text`), reporting each token to ``on_token``, then drop the ended rows."""

    def __init__(self, *args, on_token: Callable[[DecodeRow], None] = lambda row: None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_token = on_token

    def add(self, work: PrefillWork, columns: int = 0) -> list[RowOutput]:
        return self._applied(super().add(work, columns))

    def step(self, look_ahead: bool = True) -> list[RowOutput]:
        return self._applied(super().step(look_ahead))

    def _applied(self, outputs: list[RowOutput]) -> list[RowOutput]:
        for output in outputs:
            append_output(output, as_text, self.on_token)
        self.retire_finished()
        return outputs


def new_loop(model, new_cache=None, **kwargs) -> AppliedLoop:
    """An empty decode loop on ``model`` (pad 0, text from :func:`as_text`; ``new_cache`` None: plain K/V) whose
    sampled tokens are appended as the scheduler does (:class:`AppliedLoop`)."""
    return AppliedLoop(model, new_cache=new_cache, pad_token_id=0, **kwargs)


def prefill(loop: DecodeLoop, requests, alone=None, eos=DECODE_EOS) -> None:
    """Add rows for ``requests`` to ``loop`` as the scheduler plans their prefill (shared prefixes, repeated choices;
    ``alone(prompt ids, segment starts)`` names the prompts prefilled in a cache of their own; default none)."""
    rows = DecodeLoop.rows_for(requests, eos)
    never = lambda prompt_ids, segment_starts: False  # noqa: E731
    for work in prefill_works(rows, DECODE_CHUNKING, reuse=loop.new_cache is not None, alone=alone or never):
        loop.add(work)


def prefill_in_chunks(loop: DecodeLoop, requests, columns: int, eos=DECODE_EOS) -> int:
    """Prefill ``requests`` as the scheduler plans them, ``columns`` columns per call, the running rows stepping
    between calls; returns the calls that returned no token (chunks before the last)."""
    rows = DecodeLoop.rows_for(requests, eos)
    never = lambda prompt_ids, segment_starts: False  # noqa: E731
    partial = 0
    for work in prefill_works(rows, DECODE_CHUNKING, reuse=loop.new_cache is not None, alone=never):
        running = list(loop.running)
        while not loop.add(work, columns):
            assert loop.running == running  # the joining rows run only once prefilled
            partial += 1
            if loop.running:
                loop.step()
            running = list(loop.running)
    return partial


def finish(loop: DecodeLoop) -> DecodeLoop:
    """Step ``loop`` until every row finished."""
    while not loop.done:
        loop.step()
    return loop


def run_loop(model, requests, store=None, **kwargs) -> DecodeLoop:
    """Run ``requests`` to the end in one :class:`DecodeLoop` (pad 0, :data:`DECODE_EOS`), chunk-reuse caches on
    ``store`` (None: plain K/V)."""
    loop = new_loop(model, reuse_caches(store, model), **kwargs)
    prefill(loop, requests)
    return finish(loop)


class FakeLoop:
    """Records what it is handed and samples token 1 for each row per prefill and per step (with ``fail_after``:
    raises at that many steps), or what ``script`` gives: a row's next tokens per call (several: a verify round).
    A prefill handed fewer columns than its longest prompt completes once the columns handed add up to it
    (``chunks``: each call's work and columns). ``width`` models the left-padded layout: a step adds a column, a
    prefill joins as wide as the wider of the batch and its longest context, and it resets when no row runs."""

    def __init__(self, fail_after: int | None = None, script=None) -> None:
        self.fail_after = fail_after
        self.script = script or (lambda row: (1,))
        self.rows: list[DecodeRow] = []
        self.running: list[DecodeRow] = []
        self.works: list[PrefillWork] = []
        self.chunks: list[tuple[PrefillWork, int]] = []
        self.progress: dict[int, tuple[PrefillWork, int]] = {}
        self.steps = 0
        self.computed_tokens = 0
        self.closed = False
        self.width = 0

    @property
    def done(self) -> bool:
        return not self.running and not self.progress

    @property
    def columns(self) -> int:
        return self.width if self.running else 0

    def add(self, work: PrefillWork, columns: int = 0) -> list[RowOutput]:
        self.chunks.append((work, columns))
        width = max(row.context_length for row in work.rows)
        computed = self.progress.pop(id(work), (work, 0))[1] + (columns or width)
        if computed < width:
            self.progress[id(work)] = (work, computed)
            return []
        self.works.append(work)
        self.rows += work.rows
        self.computed_tokens += sum(len(row.request.prompt_ids) for row in work.rows)
        self.width = max(self.columns, width)
        self.running += work.rows
        return [self._sample(row) for row in work.rows]

    def pack(self, decode: bool, prefills) -> None:
        return None  # no forward shared with other batches: ModelRunner.run_steps calls step() and add()

    def step(self, look_ahead: bool = True) -> list[RowOutput]:
        if self.fail_after is not None and self.steps >= self.fail_after:
            raise RuntimeError("device lost")
        self.steps += 1
        self.width += 1
        return [self._sample(row) for row in self.running]

    def _sample(self, row: DecodeRow) -> RowOutput:
        tokens = tuple(self.script(row))
        return RowOutput(
            row, tokens, draft=DraftRound(len(tokens), len(tokens) - 1, False) if len(tokens) > 1 else None
        )

    def retire_finished(self) -> None:
        self.preempt([row for row in self.running + self.joining if row.finished])

    def preempt(self, rows) -> None:
        leaving = {id(row) for row in rows}
        self.running = [row for row in self.running if id(row) not in leaving]
        self.progress = {
            key: (work, n) for key, (work, n) in self.progress.items() if not all(id(r) in leaving for r in work.rows)
        }

    @property
    def joining(self) -> list[DecodeRow]:
        return [row for work, _ in self.progress.values() for row in work.rows]

    def abandon(self) -> None:
        self.running, self.progress = [], {}
        self.closed = True


# ---------------------------------------------------------------------------------------------- live server
API_KEY = "test-key"
MODEL_NAME = "SmolLM2-135M-Instruct"
SYSTEM = "You are a concise assistant. Answer in one short sentence and never use lists or headings."
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@functools.cache
def loopback_tls() -> ssl.SSLContext:
    """The one SSL context of the tests' HTTP clients. Their servers are plain http on 127.0.0.1, yet every httpx
    client (``httpx.get`` makes one per call, ``openai.OpenAI`` one per client) builds a context and loads the CA
    bundle into it (~50 ms of CPU) unless handed one. No CA is loaded here: a TLS connection would fail to verify."""
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def http_get(url: str, **kwargs: Any) -> Any:
    """``httpx.get`` on :func:`loopback_tls` (a new connection per call, as ``httpx.get``)."""
    import httpx

    return httpx.get(url, verify=loopback_tls(), **kwargs)


def http_post(url: str, **kwargs: Any) -> Any:
    """``httpx.post`` on :func:`loopback_tls`."""
    import httpx

    return httpx.post(url, verify=loopback_tls(), **kwargs)


def http_stream(method: str, url: str, **kwargs: Any) -> Any:
    """``httpx.stream`` on :func:`loopback_tls` (a context manager)."""
    import httpx

    return httpx.stream(method, url, verify=loopback_tls(), **kwargs)


def http_client(**kwargs: Any) -> Any:
    """``httpx.Client(**kwargs)`` on :func:`loopback_tls` (a client given a ``transport`` builds no context)."""
    import httpx

    return httpx.Client(verify=loopback_tls(), **kwargs)


def http_transport(**kwargs: Any) -> Any:
    """``httpx.HTTPTransport(**kwargs)`` on :func:`loopback_tls`."""
    import httpx

    return httpx.HTTPTransport(verify=loopback_tls(), **kwargs)


#: Decoder layers of :func:`short_embedded_engine` (of the embedded model's 30).
SHORT_LAYERS = 4


def short_embedded_engine(**options: Any) -> Any:
    """The engine of the servers that test the OpenAI routes: the embedded SmolLM2-135M-Instruct cut to its first
    :data:`SHORT_LAYERS` decoder layers (the others are not loaded), on the CPU. Its tokenizer, chat template,
    embeddings and head are the real ones, so requests, tool calls, stops and logprobs see real token ids; its
    forward costs about a third of the whole model's (measured: 24 greedy tokens 0.42 s against 1.41 s). The
    server's own answers are compared against transformers on this same model; fidelity on the whole model is
    ``test_server_oracle``'s. ``options``: the engine's keyword arguments."""
    import transformers

    from kvboost_hf import KVBoost
    from kvboost_hf.hf.models import load_model_and_tokenizer

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the layers left out are reported as unexpected weights
    try:
        model, tokenizer = load_model_and_tokenizer(None, device="cpu", num_hidden_layers=SHORT_LAYERS)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return KVBoost(model, tokenizer, **options)


def chat_server_settings() -> Any:
    """The ``ServerConfig`` of the module servers that test the OpenAI routes: a short batch window, 4 rows, and one
    grammar compile process, which these tests' one-at-a-time structured requests need."""
    from kvboost_hf.server.app import ServerConfig
    from kvboost_hf.server.grammar import GrammarConfig

    return ServerConfig(
        model_name=MODEL_NAME,
        api_key=API_KEY,
        batch_window_ms=30,
        max_batch_size=4,
        max_queue=16,
        grammar_limits=GrammarConfig(workers=1),
    )


class LiveServer:
    """uvicorn serving ``app`` in a daemon thread on a loopback port of its own (a context manager; start and stop
    are bounded by 30 s each). The port's socket is bound here and handed to uvicorn, so no other test process
    (pytest -n) can take the port between choosing and serving it. ``settings``: uvicorn configured from them as
    ``kvboost-hf serve`` configures it (its connection limits and timeouts); None: uvicorn's defaults."""

    def __init__(self, app, settings: Any = None) -> None:
        from kvboost_hf.server.app import GracefulServer

        self.settings = settings
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = int(self.socket.getsockname()[1])
        self.app = app
        self.server = GracefulServer(self.config(app), app.state.shutdown_worker)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def config(self, app) -> Any:
        """uvicorn's configuration of the server (host and port name the bound socket)."""
        import uvicorn

        from kvboost_hf.server.app import uvicorn_config

        where = dict(host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=30)
        if self.settings is None:
            return uvicorn.Config(app, **where)
        return uvicorn_config(app, self.settings, **where)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.socket.close()
        assert not self.thread.is_alive(), "server did not stop"

    def client(self, key: str | None = API_KEY):
        import openai

        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key=key or "none",
            max_retries=0,
            timeout=60,
            http_client=openai.DefaultHttpxClient(verify=loopback_tls()),
        )


def chat(user: str, system: str = SYSTEM) -> list[dict[str, str]]:
    """A system and a user message."""
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def metric(server: LiveServer, name: str) -> float:
    """The first sample of ``name`` in the server's ``/metrics``."""
    text = http_get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    values = [float(m) for m in re.findall(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)]
    assert values, f"{name} missing from /metrics"
    return values[0]


def metric_above(server: LiveServer, name: str, floor: float, timeout_s: float = 10.0) -> float:
    """:func:`metric` once it exceeds ``floor`` (polled for up to ``timeout_s`` seconds; the last value otherwise).
    Decode totals are counted when a batch is released, which can come after its last answer reached the client."""
    deadline = time.monotonic() + timeout_s
    while (value := metric(server, name)) <= floor and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


# ---------------------------------------------------------------------------------------------- statistics
def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic and p-value of ``counts`` against ``probs``; bins expecting < 5 draws are pooled."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return statistic, float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))
