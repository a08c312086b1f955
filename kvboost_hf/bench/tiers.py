"""``python -m kvboost_hf.bench tiers``: TTFT by store tier, and bytes per token and fidelity by K/V bit width.

TTFT: a ~1500-token prompt (a document followed by a question) on the embedded SmolLM2-135M. The document is
stored with ``engine.warm`` first (the question is not: each timed run asks a different one, so only the
document's chunks can hit); each timed ``engine.generate`` runs from the call to the first token, lookups,
decoding and dequantisation included. Sources: RAM; disk with RAM budget 0 (page cache warm, and cold after
``DiskTier.drop_page_cache``); Redis with RAM budget 0; nothing (plain prefill, ``mode="baseline"``). Beside
TTFT, ``lookup_ms`` is the time to fetch the document's chunks from each store alone (no model), which load
from other processes distorts less.

Fidelity: for each prompt (a window of the text plus a question), the chunks are stored by a first call and a
second call generates ``--new-tokens`` greedy tokens from them. Quantized stores (8, 4 bits) are compared with
the unquantized store (``16``: the model's dtype): share of prompts with identical greedy output, mean share of
the reference output that agrees before the first difference, and KL(unquantized || quantized) of the first
generated token's distribution. Bytes per token are the stored bytes (codes, scales, zeros) over the stored
tokens, also as a ratio to float16 K/V.

Store guarantees: ``model_digest`` cost on the model (and its estimate for 7B parameters in bfloat16, scaled by
bytes); Redis fetch time of a ``--redis-chunks``-chunk prompt (chunks shaped like the model's, in its dtype) with
one GET per chunk and with one pipelined batch (``ChunkStore.get_many``); entries that survive a SIGKILL of a
process that stored ``--kill-entries`` chunks with a disk tier, killed right after its last ``put`` and 5 s later;
chunks flushed by 3 processes sharing one disk directory that a new store finds there.

Writes ``tiers.json`` and ``tiers.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvboost_hf.bench.common import machine_info, parser_for, pyplot, save_results
from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.core.chunking import ChunkingConfig, chunk_spans
from kvboost_hf.core.keys import chain_prefix_keys, forget_model_digest, model_digest
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.hf.models import CACHE_ARGUMENT
from kvboost_hf.store.chunk_store import ChunkStore
from kvboost_hf.store.config import StoreConfig

logger = logging.getLogger(__name__)

TARGETS = {"disk_vs_ram": 1.5, "redis_vs_ram": 2.0, "int8_fp16_ratio": 0.55, "int4_fp16_ratio": 0.30}
BITS = (16, 8, 4)
_QUESTIONS = (
    "Which module above handles command-line options?",
    "What does the text say about threads?",
    "Name one function described above.",
    "Summarise the first paragraph.",
    "What is the purpose of the logging module?",
    "Which errors can be raised?",
    "How are subprocesses started?",
    "What data structures are mentioned?",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = parser_for("tiers", __doc__)
    parser.add_argument("--dtype", default=None, help="model dtype (default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--chunk-size", type=int, default=ChunkingConfig.chunk_size, help="tokens per chunk")
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="length of the TTFT prompt (tokens)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per tier (median reported)")
    parser.add_argument("--redis-url", default=None, help="Redis to use (default: a private redis-server)")
    parser.add_argument("--fidelity-prompts", type=int, default=24, help="prompts for the fidelity comparison")
    parser.add_argument("--fidelity-tokens", type=int, default=400, help="text tokens per fidelity prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    parser.add_argument("--redis-chunks", type=int, default=10, help="chunks of the batched Redis fetch")
    parser.add_argument("--kill-entries", type=int, default=40, help="chunks stored before the SIGKILL")
    return parser.parse_args(argv)


def corpus_text() -> str:
    """Deterministic English text for a given Python version: docstrings of well-documented stdlib modules."""
    import argparse as m1
    import collections as m2
    import json as m3
    import logging as m4
    import subprocess as m5
    import threading as m6
    import unittest as m7

    parts = []
    for module in (m5, m1, m4, m6, m2, m3, m7):
        parts.append(inspect.getdoc(module) or "")
        for _, obj in sorted(
            inspect.getmembers(module, inspect.isclass) + inspect.getmembers(module, inspect.isfunction)
        ):
            if getattr(obj, "__module__", "") == module.__name__ and (doc := inspect.getdoc(obj)):
                parts.append(doc)
    return "\n\n".join(parts)


@contextlib.contextmanager
def redis_server(url: str | None) -> Iterator[str | None]:
    """``url`` itself, or the URL of a private redis-server started for the run (None if none can be had)."""
    if url is not None:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        logger.warning("no --redis-url and no redis-server binary: the Redis tier is not measured")
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as directory:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", directory, "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            private = f"redis://127.0.0.1:{port}/0"
            import redis

            client = redis.Redis.from_url(private, socket_connect_timeout=0.2)
            for _ in range(100):
                with contextlib.suppress(redis.ConnectionError):
                    if client.ping():
                        break
                time.sleep(0.05)
            yield private
        finally:
            process.terminate()
            process.wait(10)


def _document(engine: InferenceEngine, corpus: str, tokens: int) -> str:
    """A prefix of ``corpus`` of about ``tokens`` tokens, ending at a line break."""
    ids = engine.tokenizer(corpus, add_special_tokens=False)["input_ids"][:tokens]
    text = engine.tokenizer.decode(ids)
    return text[: text.rfind("\n") + 1] if "\n" in text else text


@dataclass
class _Source:
    """One way of serving the document's K/V; ``before_each`` runs untimed before every timed call."""

    name: str
    engine: InferenceEngine
    mode: str = "chunk_kv_reuse"
    before_each: Callable[[], None] | None = None
    keys: list[str] = field(default_factory=list)  # the document's chunk keys (empty: no store lookups)
    runs: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    lookups: list[float] = field(default_factory=list)

    def lookup_ms(self) -> float:
        """Time to fetch every document chunk from the store alone (no model), in ms."""
        if self.before_each is not None:
            self.before_each()
        started = time.perf_counter()
        for key in self.keys:
            if self.engine.store.get(key) is None:
                raise RuntimeError(f"{self.name}: document chunk missing from the store")
        return (time.perf_counter() - started) * 1e3


def measure_ttft(engine: InferenceEngine, document: str, args: argparse.Namespace, url: str | None) -> dict:
    """TTFT (ms) per source, and the time to fetch the document's chunks from each store alone. Every source
    answers the same ``repeats`` questions about ``document``; the sources take turns within each repeat so that
    load from other processes spreads over all of them."""
    questions = [f"\nQuestion: {_QUESTIONS[r % len(_QUESTIONS)]}\nAnswer:" for r in range(args.repeats)]
    engine.generate("Warm-up call: load kernels.", max_new_tokens=2, mode="baseline")
    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(tempfile.TemporaryDirectory())
        stores = {
            "ram": ChunkStore(StoreConfig(2 << 30)),
            "disk": ChunkStore(StoreConfig(0, disk_cache_dir=directory, disk_max_bytes=2 << 30)),
        }
        if url is not None:
            stores["redis"] = ChunkStore(
                StoreConfig(0, remote_url=url, remote_prefix=f"kvboost-bench-{time.time_ns()}:")
            )
        for store in stores.values():
            stack.callback(store.close)
        sources = [_Source("full_prefill", engine, mode="baseline")]
        for name, store in stores.items():
            tier_engine = _engine_with(engine, store)
            tier_engine.warm(document)
            store.flush()
            sources.append(_Source(name, tier_engine, keys=_document_keys(tier_engine, document)))
        disk = stores["disk"].disk
        assert disk is not None
        sources.append(_Source("disk_cold", sources[2].engine, before_each=disk.drop_page_cache, keys=sources[2].keys))
        for question in questions:
            for source in sources:
                if source.before_each is not None:
                    source.before_each()
                result = source.engine.generate(document + question, max_new_tokens=1, mode=source.mode)
                source.engine.store.flush()  # untimed: background writes must not overlap the next timed call
                source.runs.append(result.ttft_ms)
                source.cached.append(result.cached_tokens)
                if source.keys:
                    source.lookups.append(source.lookup_ms())
        results: dict[str, Any] = {}
        for source in sources:
            stats = source.engine.store.stats()
            results[source.name] = {
                "ttft_ms_median": statistics.median(source.runs),
                "ttft_ms_runs": source.runs,
                "cached_tokens": source.cached,
                "prompt_tokens": result.prompt_tokens,
                "tier_hits": {k: stats[k] for k in ("ram_hits", "disk_hits", "remote_hits")},
            }
            if source.lookups:
                results[source.name] |= {
                    "lookup_ms_median": statistics.median(source.lookups),
                    "lookup_ms_runs": source.lookups,
                    "lookup_chunks": len(source.keys),
                }
            logger.info(
                "%-12s TTFT median %8.1f ms, cached %s", source.name, statistics.median(source.runs), source.cached
            )
        if "redis" in stores:
            stores["redis"].clear(remote=True)
    ram = results["ram"]["ttft_ms_median"]
    for entry in results.values():
        entry["vs_ram"] = entry["ttft_ms_median"] / ram
    return results


def _document_keys(engine: InferenceEngine, document: str) -> list[str]:
    """Prefix keys of the full chunks of ``document`` as ``engine`` names them."""
    ids = engine.encode(document, add_generation_prompt=False)
    return chain_prefix_keys(engine.new_cache().namespace, ids, chunk_spans(ids, engine.chunking))


def _engine_with(engine: InferenceEngine, store: ChunkStore) -> InferenceEngine:
    return InferenceEngine(engine.model, engine.tokenizer, chunking=engine.chunking, store=store)


def _model_shaped_chunk(engine: InferenceEngine, tokens: int, seed: int) -> ChunkKV:
    """Random K/V shaped like ``engine``'s model's for ``tokens`` tokens, in its dtype."""
    config = engine.model.config.get_text_config(decoder=True)
    heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (config.num_hidden_layers, heads, tokens, head_dim)
    gen = torch.Generator().manual_seed(seed)
    dtype = next(engine.model.parameters()).dtype
    return ChunkKV(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))


def measure_digest(engine: InferenceEngine) -> dict:
    """Time of :func:`model_digest` over every weight (uncached), and its estimate for 7B bfloat16 weights."""
    weight_bytes = sum(t.numel() * t.element_size() for t in [*engine.model.parameters(), *engine.model.buffers()])
    runs = []
    for _ in range(3):
        forget_model_digest(engine.model)
        started = time.perf_counter()
        model_digest(engine.model)
        runs.append((time.perf_counter() - started) * 1e3)
    ms = statistics.median(runs)
    return {"ms": ms, "weight_bytes": weight_bytes, "estimate_7b_bf16_ms": ms * (7e9 * 2) / weight_bytes}


def measure_redis_batching(engine: InferenceEngine, url: str, args: argparse.Namespace) -> dict:
    """Fetch time (ms, median) of a prompt's ``--redis-chunks`` chunks from Redis: one GET each, then one batch."""
    keys = [f"{i:064x}" for i in range(args.redis_chunks)]
    prefix = f"kvboost-bench-batch-{time.time_ns()}:"  # a long read timeout: measure, do not give up under load
    with ChunkStore(StoreConfig(0, remote_url=url, remote_prefix=prefix, remote_read_timeout_s=5.0)) as store:
        remote = store.remote
        assert remote is not None
        for i, key in enumerate(keys):
            store.put(key, _model_shaped_chunk(engine, args.chunk_size, i))
        store.flush()
        sequential, batched = [], []
        for _ in range(max(3, args.repeats)):
            started = time.perf_counter()
            one_by_one = [remote.get(key) for key in keys]
            sequential.append((time.perf_counter() - started) * 1e3)
            started = time.perf_counter()
            together = remote.get_many(keys)
            batched.append((time.perf_counter() - started) * 1e3)
            if None in one_by_one or None in together:
                raise RuntimeError("a chunk is missing from Redis")
        record_bytes = remote.written_bytes // max(1, remote.written)
        store.clear(remote=True)
    return {
        "chunks": len(keys),
        "record_bytes": record_bytes,
        "sequential_ms_median": statistics.median(sequential),
        "batched_ms_median": statistics.median(batched),
    }


_KILLED_STORE = """
import os, sys, time, torch
from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.store.chunk_store import ChunkStore, StoreConfig

directory, count, wait_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[4])
shape = tuple(int(n) for n in sys.argv[3].split(","))
store = ChunkStore(StoreConfig(1 << 34, disk_cache_dir=directory))
for i in range(count):
    gen = torch.Generator().manual_seed(i)
    store.put(f"{i:064x}", ChunkKV(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)))
time.sleep(wait_s)
os.kill(os.getpid(), 9)
"""


def measure_kill9(engine: InferenceEngine, args: argparse.Namespace) -> dict:
    """Entries a new store finds on disk after a process stored ``--kill-entries`` chunks and was SIGKILLed
    right after its last put, and 5 s later (verified: every one read back is the chunk that was stored)."""
    config = engine.model.config.get_text_config(decoder=True)
    shape = _model_shaped_chunk(engine, args.chunk_size, 0).keys.shape
    out: dict[str, Any] = {"stored": args.kill_entries, "chunk_shape": list(shape), "layers": config.num_hidden_layers}
    for wait_s in (0.0, 5.0):
        with tempfile.TemporaryDirectory() as directory:
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    _KILLED_STORE,
                    directory,
                    str(args.kill_entries),
                    ",".join(map(str, shape)),
                    str(wait_s),
                ],
                check=False,
                timeout=600,
            )
            with ChunkStore(StoreConfig(0, disk_cache_dir=directory)) as store:
                found = [store.get(f"{i:064x}") for i in range(args.kill_entries)]
            for i, entry in enumerate(found):
                gen = torch.Generator().manual_seed(i)
                if entry is not None and not torch.equal(entry.keys, torch.randn(tuple(shape), generator=gen)):
                    raise RuntimeError(f"entry {i} read back after the kill differs from what was stored")
            out[f"survived_after_{wait_s:g}s"] = sum(entry is not None for entry in found)
    return out


_SHARING_STORE = """
import json, sys, torch
from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.store.chunk_store import ChunkStore, StoreConfig

directory, me, processes, rounds, per = sys.argv[1], *map(int, sys.argv[2:6])
shape = tuple(int(n) for n in sys.argv[6].split(","))
store = ChunkStore(StoreConfig(0, disk_cache_dir=directory))  # no RAM: every lookup reads (and checks) the shared file
for r in range(rounds):
    for i in range(per):
        gen = torch.Generator().manual_seed(me * 10**6 + r * 1000 + i)
        keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        store.put(f"{me:08x}{r:08x}{i:048x}", ChunkKV(keys, values))
    store.flush()
    for other in range(processes):  # look up what the others flushed in this round, as a replica would
        for i in range(per):
            store.get(f"{other:08x}{r:08x}{i:048x}")
stats = store.stats()
store.close()
rechecks = stats.get("disk_rechecks", 0)  # absent before the counter existed
print(json.dumps({"flushed": rounds * per, "disabled": stats["disk_disabled"], "rechecks": rechecks}))
"""


def measure_shared_directory(
    processes: int = 3, rounds: int = 40, per_round: int = 40, shape: tuple[int, ...] = (2, 3, 64, 8)
) -> dict:
    """``processes`` processes write ``per_round`` chunks of ``shape`` to one ``disk_cache_dir``, flush, and
    read the others' chunks, ``rounds`` times; then a new store counts what is on disk (the budget holds it all).
    Reports chunks flushed, chunks found, processes whose disk tier was disabled, and rechecks."""
    with tempfile.TemporaryDirectory() as directory:
        argv = [directory, "", str(processes), str(rounds), str(per_round), ",".join(map(str, shape))]
        started = time.perf_counter()
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _SHARING_STORE, *[str(me) if a == "" else a for a in argv]],
                stdout=subprocess.PIPE,
                text=True,
            )
            for me in range(processes)
        ]
        reports = [json.loads(proc.communicate(timeout=600)[0].strip().splitlines()[-1]) for proc in procs]
        seconds = time.perf_counter() - started
        with ChunkStore(StoreConfig(0, disk_cache_dir=directory)) as store:
            assert store.disk is not None
            found = len(store.disk)
    return {
        "processes": processes,
        "flushed": sum(r["flushed"] for r in reports),
        "found_on_disk": found,
        "disabled_processes": sum(r["disabled"] for r in reports),
        "rechecks": sum(r["rechecks"] for r in reports),
        "seconds": round(seconds, 1),
    }


def _stored_generation(
    engine: InferenceEngine, ids: torch.Tensor, bits: int, args: argparse.Namespace, acc: dict[str, Any]
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and first-step logits of ``ids`` continued from K/V stored at ``bits`` (a fresh store that the
    prompt's first pass filled); the stored bytes and tokens are added to ``acc``."""
    model, tokenizer = engine.model, engine.tokenizer
    options = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=tokenizer.eos_token_id)
    store = ChunkStore(StoreConfig(1 << 30, kv_cache_bits=bits))
    with torch.inference_mode():
        first = ChunkReuseCache(store, model, args.chunk_size)
        model.generate(ids, **{CACHE_ARGUMENT: first}, max_new_tokens=1, **options)  # saves its chunks
        cache = ChunkReuseCache(store, model, args.chunk_size, write_back=False)
        out = model.generate(
            ids,
            **{CACHE_ARGUMENT: cache},
            max_new_tokens=args.new_tokens,
            return_dict_in_generate=True,
            output_logits=True,
            **options,
        )
    if cache.last_reuse[0].cached_tokens == 0:
        raise RuntimeError("fidelity prompt got no stored chunks; is the prompt shorter than a chunk?")
    acc["bytes"] += store.stats()["ram_bytes"]
    acc["tokens"] += sum(entry.num_tokens for _, entry in store.ram.items())
    return out.sequences[0, ids.shape[1] :].tolist(), out.logits[0][0].double()


def measure_fidelity(engine: InferenceEngine, corpus: str, args: argparse.Namespace) -> dict:
    """Bytes per token and agreement with the unquantized store, per bit width."""
    model, tokenizer = engine.model, engine.tokenizer
    corpus_ids = tokenizer(corpus, add_special_tokens=False)["input_ids"]
    stride = max(1, (len(corpus_ids) - args.fidelity_tokens) // max(1, args.fidelity_prompts))
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    fp16_bytes_per_token = 2 * 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    per_bits: dict[int, dict[str, Any]] = {
        b: {"bytes": 0, "tokens": 0, "identical": 0, "prefix": [], "kl": []} for b in BITS
    }
    for i in range(args.fidelity_prompts):
        window = corpus_ids[i * stride : i * stride + args.fidelity_tokens]
        question = tokenizer(f"\nQuestion: {_QUESTIONS[i % len(_QUESTIONS)]}\nAnswer:", add_special_tokens=False)
        ids = torch.tensor([window + question["input_ids"]], device=engine.device)
        outputs = {bits: _stored_generation(engine, ids, bits, args, per_bits[bits]) for bits in BITS}
        reference, reference_logits = outputs[16]
        for bits in BITS:
            tokens, logits = outputs[bits]
            prefix = next(
                (j for j, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), len(reference)
            )
            per_bits[bits]["identical"] += int(tokens == reference)
            per_bits[bits]["prefix"].append(prefix / len(reference))  # the reference may stop early at EOS
            kl = torch.nn.functional.kl_div(
                logits.log_softmax(-1), reference_logits.log_softmax(-1), log_target=True, reduction="sum"
            )
            per_bits[bits]["kl"].append(float(kl))
        logger.info("fidelity prompt %d/%d done", i + 1, args.fidelity_prompts)
    report = {}
    for bits, acc in per_bits.items():
        bytes_per_token = acc["bytes"] / acc["tokens"]
        report[str(bits)] = {
            "bytes_per_token": bytes_per_token,
            "ratio_vs_fp16": bytes_per_token / fp16_bytes_per_token,
            "identical_greedy_share": acc["identical"] / args.fidelity_prompts,
            "mean_agreeing_prefix_share": statistics.mean(acc["prefix"]),
            "first_token_kl_mean": statistics.mean(acc["kl"]),
            "first_token_kl_max": max(acc["kl"]),
        }
    return {"fp16_bytes_per_token": fp16_bytes_per_token, "by_bits": report}


def report_table(result: dict) -> str:
    """TTFT and lookup time by source, then bytes and fidelity by bit width, as text."""
    lines = [f"{'source':<13}{'TTFT ms':>10}{'x RAM':>8}{'lookup ms':>11}"]
    for source, row in result["ttft"].items():
        lookup = f"{row['lookup_ms_median']:11.1f}" if "lookup_ms_median" in row else f"{'-':>11}"
        lines.append(f"{source:<13}{row['ttft_ms_median']:10.1f}{row['vs_ram']:8.2f}{lookup}")
    guarantees = result.get("guarantees", {})
    if digest := guarantees.get("digest"):
        lines.append(
            f"model_digest: {digest['ms']:.0f} ms over {digest['weight_bytes'] / 2**20:.0f} MiB of weights "
            f"(7B bf16 estimate: {digest['estimate_7b_bf16_ms'] / 1e3:.1f} s)"
        )
    if batching := guarantees.get("redis_batching"):
        lines.append(
            f"Redis fetch of {batching['chunks']} chunks of {batching['record_bytes'] / 2**20:.2f} MiB: "
            f"{batching['sequential_ms_median']:.1f} ms one GET each, {batching['batched_ms_median']:.1f} ms batched"
        )
    if kill := guarantees.get("kill9"):
        lines.append(
            f"SIGKILL after {kill['stored']} puts: {kill['survived_after_0s']} survive when killed at once, "
            f"{kill['survived_after_5s']} after 5 s"
        )
    if shared := guarantees.get("shared_directory"):
        lines.append(
            f"{shared['processes']} processes on one disk directory: {shared['found_on_disk']} of {shared['flushed']} "
            f"flushed chunks on disk, {shared['disabled_processes']} disabled, {shared['rechecks']} rechecks"
        )
    lines.append(f"{'bits':<6}{'B/token':>9}{'x fp16':>8}{'identical':>11}{'prefix':>8}{'KL mean':>10}")
    for bits, row in result["fidelity"]["by_bits"].items():
        lines.append(
            f"{bits:<6}{row['bytes_per_token']:9.0f}{row['ratio_vs_fp16']:8.3f}{row['identical_greedy_share']:11.0%}"
            f"{row['mean_agreeing_prefix_share']:8.0%}{row['first_token_kl_mean']:10.2e}"
        )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Two panels: TTFT by source, bytes per token by bit width (skipped without matplotlib)."""
    try:
        plt = pyplot()
    except ImportError:
        logger.warning("matplotlib is not installed: no PNG")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ttft = report["ttft"]
    sources = list(ttft)
    left.bar(sources, [ttft[s]["ttft_ms_median"] for s in sources], color="tab:blue")
    left.set_ylabel("TTFT (ms, median)")
    left.set_title(f"TTFT, {ttft['full_prefill']['prompt_tokens']}-token prompt")
    left.tick_params(axis="x", rotation=20)
    by_bits = report["fidelity"]["by_bits"]
    dtype = report["machine"]["model_dtype"].removeprefix("torch.")
    names = {"16": f"unquantized\n({dtype})", "8": "int8", "4": "int4"}
    labels = [f"{names[b]}\n{by_bits[b]['identical_greedy_share']:.0%} identical" for b in by_bits]
    right.bar(labels, [by_bits[b]["bytes_per_token"] / 1024 for b in by_bits], color="tab:green")
    right.axhline(report["fidelity"]["fp16_bytes_per_token"] / 1024, color="gray", linestyle="--", label="float16")
    right.set_ylabel("stored KiB per token")
    right.set_title("K/V storage and greedy agreement")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    engine = InferenceEngine.from_pretrained(None, chunking=args.chunk_size, dtype=args.dtype)
    corpus = corpus_text()
    document = _document(engine, corpus, args.prompt_tokens - 20)
    with redis_server(args.redis_url) as url:
        ttft = measure_ttft(engine, document, args, url)
        batching = measure_redis_batching(engine, url, args) if url is not None else None
    guarantees = {
        "digest": measure_digest(engine),
        "redis_batching": batching,
        "kill9": measure_kill9(engine, args),
        "shared_directory": measure_shared_directory(),
    }
    fidelity = measure_fidelity(engine, corpus, args)
    report = {
        "machine": machine_info(engine.device) | {"model_dtype": str(next(engine.model.parameters()).dtype)},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "targets": TARGETS,
        "ttft": ttft,
        "guarantees": guarantees,
        "fidelity": fidelity,
    }
    save_results(args.out, "tiers", report, report_table, plot)
    return 0
