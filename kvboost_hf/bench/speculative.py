"""``python -m kvboost_hf.bench speculative``: plain vs speculative decoding side by side, draft lengths 1..8.

The embedded SmolLM2-135M is the target (resident); ``--model DIR`` takes a local model instead, ``--random-shape
NAME`` a random-weight model of a real shape (:mod:`kvboost_hf.bench.shapes`; ``--dtype`` for either). Drafts
that need no second checkpoint:

* ``copy``: a second resident copy of the target (the same weights, copied before the target streams; only worth it
  when the target's forwards are expensive, e.g. streamed: here it costs as much as the target per token);
* ``bf16``: the same weights in bfloat16 (a cheaper, slightly different draft);
* ``earlyN``: the target's own first N layers and head (transformers' ``assistant_early_exit``);
* ``awq``: the target packed to AWQ int4 (group size 64, :mod:`kvboost_hf.tools.awq_pack`) and loaded in fp16
  through gptqmodel (the ``awq`` extra): the resident draft of a full-precision streamed target.
* ``rtn4``: the same int4 weights as ``awq``, dequantized into a copy in the target's dtype
  (:func:`~kvboost_hf.tools.awq_pack.round_trip_int4`): the int4 copy's function without gptqmodel's slow CPU kernel
  (its logits differ from ``awq``'s by fp16 rounding only).

With ``--streaming`` the same runs repeat with the target's decoder layers streamed (all but the first and the
last, :mod:`kvboost_hf.offload`), where each target forward pays for copying the weights and the streamed bytes
per generated token are reported too, with the copy bandwidth (pinned host-to-device on CUDA, memcpy on CPU) and
the bound it sets, ``bandwidth / streamed bytes per generated token``, beside each streamed row's tok/s.

On a random-weight target only the mechanics are figures (tok/s, target forwards and streamed bytes per token
against the bound): a copy draft's acceptance is trivially about 1, and acceptance, like output fidelity, needs
real weights (``--model``).

Each prompt is generated greedily (``--max-new-tokens``) ``--repeats`` times without a draft and per draft and draft
length ``g``, after untimed warm-up calls (one per prompt and per draft) that also store the prompts' chunks: decode
speed, not prefill, is measured; tok/s is the median over prompts and repeats.
Reported per row: decode tok/s (tokens after the first step / time after it), target forwards per generated
token, the draft acceptance rate r = accepted / proposed, the per-position acceptance a = P(accept | previous
accepted), the i.i.d. model's tokens per verify (1 - a^(g+1)) / (1 - a) beside the measured tokens per target
forward, and where the output first differs from the resident plain greedy output (``=``: identical, over all
prompts; the resident ``plain`` row compares a second plain run with the first: the noise floor). Writes
``speculative.json`` and ``speculative.png`` under ``--out``.

``--graphs`` picks how the draft engines' verify forwards (and plain decode steps) run: ``auto`` (the engine's
default: graphed on CUDA, eager elsewhere), ``on``, ``off``, or ``both``: each draft twice, eager (``copy``) and
graphed (``copy+graphs``), side by side. A graphed row first runs each prompt once untimed at its draft length (the
graphs of its draft-token bucket compiled then). Every row reports ``graphed_verifies`` and ``eager_verifies``, the
timed runs' verify forwards after the prompt forward that ran graphed (:mod:`kvboost_hf.hf.verify_graphs`) and
eagerly (column ``graphed``: the graphed share).
"""

from __future__ import annotations

import re
import statistics
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from kvboost_hf.bench import speculative_tree
from kvboost_hf.bench.common import (
    agreement_label,
    earliest_difference,
    first_difference,
    machine_info,
    parser_for,
    pyplot,
    save_results,
)
from kvboost_hf.bench.shapes import DTYPES, SHAPES, copy_model, random_engine
from kvboost_hf.bench.streaming import copy_bandwidth
from kvboost_hf.corpus import sample_prompts
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.graphs import GraphConfig
from kvboost_hf.hf.models import embedded_model_dir, load_model_and_tokenizer
from kvboost_hf.hf.speculative import TREE_EXPANSIONS, DraftConfig
from kvboost_hf.offload import LayerStreamingConfig, enable_layer_streaming, layer_streamer
from kvboost_hf.results import GenerationResult
from kvboost_hf.tools.awq_pack import pack_checkpoint, round_trip_int4


def expected_tokens_per_verify(a: float, g: int) -> float:
    """Tokens one verify forward yields when each of ``g`` draft tokens is accepted with probability ``a``
    independently of position, until the first rejection: ``(1 - a^(g+1)) / (1 - a)`` (``g + 1`` at a = 1)."""
    return float(g + 1) if a >= 1.0 else (1.0 - a ** (g + 1)) / (1.0 - a)


GRAPH_ARMS: dict[str, tuple[tuple[str, GraphConfig | None], ...]] = {
    "auto": (("", None),),
    "on": (("", GraphConfig()),),
    "off": (("", GraphConfig(enabled=False)),),
    "both": (("", GraphConfig(enabled=False)), ("+graphs", GraphConfig())),
}
"""``--graphs``: per choice, the draft engines' (row name suffix, graph settings; None: the engine's default)."""
VERIFY_COUNTERS = ("graphed_verifies", "eager_verifies")
"""The engines' ``cache_stats()`` counters (``graph_`` prefixed there) each row reports for its timed runs."""


def draft_engine(
    target: InferenceEngine, kind: str, model: str | None = None, graphs: GraphConfig | None = None
) -> InferenceEngine:
    """An engine on the target's model and store with the draft named ``kind`` (copy, bf16, awq, rtn4 or earlyN).
    ``copy``, ``bf16`` and ``rtn4`` start from a copy of the target's own weights (a streamed target's checkpoint
    is loaded again instead: a random-weight target must be copied before it streams), or load ``model`` (hub name
    or directory: a smaller checkpoint with the target's tokenizer) when given;
    ``awq`` packs ``model`` (a local directory; ``None``: the embedded model). ``graphs``: its graph settings
    (None: the engine's default)."""
    if match := re.fullmatch(r"early(\d+)", kind):
        size, store, exit_layers = target.chunking.chunk_size, target.store, int(match.group(1))
        draft_settings = DraftConfig(early_exit_layers=exit_layers)
        return InferenceEngine(
            target.model, target.tokenizer, chunking=size, store=store, draft=draft_settings, graphs=graphs
        )
    if kind not in ("copy", "bf16", "awq", "rtn4"):
        raise ValueError(f"unknown draft {kind!r}: use copy, bf16, awq, rtn4 or earlyN (N layers of the target)")
    if kind == "awq":
        packed = Path(tempfile.mkdtemp(prefix="kvboost-awq-draft-"))
        pack_checkpoint(model if model is not None else embedded_model_dir(), packed, group_size=64)
        draft, _ = load_model_and_tokenizer(str(packed), device=target.device, dtype=torch.float16)
    else:
        dtype = torch.bfloat16 if kind == "bf16" else target.model.dtype
        if model is None and layer_streamer(target.model) is None:
            draft = copy_model(target.model, dtype=dtype)
        else:  # a checkpoint: the one named, or a streamed target's own loaded again
            draft, _ = load_model_and_tokenizer(model or target.model.name_or_path, device=target.device, dtype=dtype)
        if kind == "rtn4":
            round_trip_int4(draft, group_size=64)
    return InferenceEngine(
        target.model, target.tokenizer, chunking=target.chunking, store=target.store, draft_model=draft, graphs=graphs
    )


def summarise(results: list[GenerationResult], plain: list[GenerationResult], g: int | None) -> dict:
    """One row: medians over prompts of speed and acceptance, sums of tokens and forwards, and the earliest token
    at which an output differs from ``plain``'s output for the same prompt."""
    tokens = sum(r.generated_tokens for r in results)
    forwards = sum(r.target_forwards for r in results)
    streamed = [r.streamed_bytes_per_token for r in results if r.streamed_bytes_per_token is not None]
    row = {
        "draft_tokens": g,
        "streamed_mb_per_token": statistics.mean(streamed) / 1e6 if streamed else None,
        "decode_tok_s": statistics.median(r.tokens_per_sec for r in results),
        "target_forwards_per_token": forwards / tokens,
        "tokens_per_target_forward": tokens / forwards,
        "first_difference": earliest_difference(
            [first_difference(r.output_ids, p.output_ids) for r, p in zip(results, plain, strict=True)]
        ),
    }
    row["outputs_identical"] = row["first_difference"] is None
    if g is not None:
        proposed = sum(r.draft_tokens_proposed for r in results)
        accepted = sum(r.draft_tokens_accepted for r in results)
        a = statistics.mean(r.draft_position_acceptance or 0.0 for r in results)
        row.update(
            acceptance_rate=accepted / max(proposed, 1),
            position_acceptance=a,
            expected_tokens_per_verify=expected_tokens_per_verify(a, g),
        )
    return row


def target_engine(model: str | None, random_shape: str | None, dtype: str | None, chunk_size: int) -> InferenceEngine:
    """The target: random weights of shape ``random_shape``, else ``model`` (None: the embedded model), in ``dtype``
    (None: float32 on CPU, bfloat16 on GPU)."""
    if random_shape is not None:
        return random_engine(random_shape, dtype=dtype, chunking=chunk_size)
    return InferenceEngine.from_pretrained(model, dtype=dtype, chunking=chunk_size)


def run(
    drafts: list[str],
    lengths: list[int],
    prompts: int,
    repeats: int,
    max_new_tokens: int,
    chunk_size: int,
    streaming: bool,
    *,
    model: str | None = None,
    random_shape: str | None = None,
    dtype: str | None = None,
    copy_mb: int = 256,
    graphs: str = "auto",
) -> dict:
    """Rows per placement of the target (resident, streamed) and draft: ``plain`` first, then one per ``g``.
    The target: :func:`target_engine` ``(model, random_shape, dtype, chunk_size)``; ``graphs``: a
    :data:`GRAPH_ARMS` choice."""
    target = target_engine(model, random_shape, dtype, chunk_size)
    texts = sample_prompts(prompts)
    engines = {
        kind + suffix: draft_engine(target, kind, graphs=config)
        for kind in drafts
        for suffix, config in GRAPH_ARMS[graphs]
    }
    for engine in (target, *engines.values()):  # untimed: stores the prompts' chunks, pays one-time costs
        for text in texts:
            engine.generate(text, max_new_tokens=max_new_tokens)
    texts = texts * repeats
    rows: dict[str, dict[str, list[dict]]] = {}
    resident_plain: list[GenerationResult] = []
    bandwidth: dict = {}
    for placement in ("resident", "streamed") if streaming else ("resident",):
        if placement == "streamed":
            bandwidth = copy_bandwidth(target.device, copy_mb)
            enable_layer_streaming(target.model, LayerStreamingConfig(keep_first_k=1, keep_last_k=1))
        plain = [target.generate(text, max_new_tokens=max_new_tokens) for text in texts]
        if not resident_plain:  # the noise floor: plain generation run a second time
            resident_plain = [target.generate(text, max_new_tokens=max_new_tokens) for text in texts]
        rows[placement] = {"plain": [summarise(plain, resident_plain, None)]}
        for kind, engine in engines.items():
            exit_layers = engine.draft_settings.early_exit_layers
            rows[placement][kind] = []
            for g in tqdm(lengths, desc=f"{placement} target, draft {kind}"):
                engine.draft_settings = DraftConfig(g, early_exit_layers=exit_layers)
                if engine.graphs.config.enabled:  # untimed: this draft length's graphs compile here
                    for text in texts[:prompts]:
                        engine.generate(text, max_new_tokens=max_new_tokens)
                before = engine.cache_stats()
                results = [engine.generate(text, max_new_tokens=max_new_tokens) for text in texts]
                after = engine.cache_stats()
                row = summarise(results, resident_plain, g)
                row.update({name: after[f"graph_{name}"] - before[f"graph_{name}"] for name in VERIFY_COUNTERS})
                rows[placement][kind].append(row)
    bound_gbps = bandwidth.get("h2d_pinned_gbps", bandwidth.get("memcpy_gbps"))
    for row in (r for by_draft in rows.get("streamed", {}).values() for r in by_draft):
        if bound_gbps and row["streamed_mb_per_token"]:
            row["bound_tok_s"] = bound_gbps * 1e3 / row["streamed_mb_per_token"]
            row["share_of_bound"] = row["decode_tok_s"] / row["bound_tok_s"]
    return {
        "benchmark": "speculative",
        "machine": machine_info(target.device),
        "model": target.model.config._name_or_path,
        "weights": "random" if random_shape is not None else "trained",
        "dtype": str(target.model.dtype),
        "prompts": prompts,
        "repeats": repeats,
        "max_new_tokens": max_new_tokens,
        "bandwidth": bandwidth,
        "graphs": graphs,
        "rows": rows,
    }


def _mb(row: dict) -> str:
    return "-" if row["streamed_mb_per_token"] is None else f"{row['streamed_mb_per_token']:.0f}"


def _bound(row: dict) -> str:
    return f"{row['bound_tok_s']:.1f} ({100 * row['share_of_bound']:.0f}%)" if "bound_tok_s" in row else "-"


def report(result: dict) -> str:
    lines = []
    if result.get("weights") == "random":
        lines.append(
            "random weights: only the mechanics are figures (tok/s, forwards and streamed bytes per token, bound); "
            "acceptance and output agreement need real weights (--model)"
        )
    if result.get("bandwidth"):
        gbps = ", ".join(f"{k} {v:.1f}" for k, v in result["bandwidth"].items() if k.endswith("_gbps"))
        lines.append(f"copy bandwidth GB/s: {gbps}; bound = bandwidth / streamed bytes per generated token")
    for placement, by_draft in result["rows"].items():
        plain = by_draft["plain"][0]
        versus = "a second plain run (noise floor)" if placement == "resident" else "resident plain"
        difference = agreement_label(plain["first_difference"])
        lines += [
            f"{placement} target, plain: {plain['decode_tok_s']:.2f} tok/s, {_mb(plain)} MB streamed/token, "
            f"bound tok/s {_bound(plain)}, first difference from {versus}: {difference}",
            f"{'draft':>12} {'g':>2} {'tok/s':>7} {'vs plain':>8} {'fwd/tok':>7} {'MB/tok':>6} {'bound tok/s':>12} "
            f"{'r':>5} {'a':>5} {'tok/verify':>10} {'expected':>8} {'same':>5} {'graphed':>7}",
        ]
        for kind, rows in by_draft.items():
            for row in rows if kind != "plain" else []:
                lines.append(
                    f"{kind:>12} {row['draft_tokens']:>2} {row['decode_tok_s']:>7.2f} "
                    f"{row['decode_tok_s'] / plain['decode_tok_s']:>7.2f}x {row['target_forwards_per_token']:>7.2f} "
                    f"{_mb(row):>6} {_bound(row):>12} {row['acceptance_rate']:>5.2f} "
                    f"{row['position_acceptance']:>5.2f} "
                    f"{row['tokens_per_target_forward']:>10.2f} {row['expected_tokens_per_verify']:>8.2f} "
                    f"{agreement_label(row['first_difference']):>5} {_graphed(row):>7}"
                )
    return "\n".join(lines)


def _graphed(row: dict) -> str:
    """The share of a row's verify forwards (after the prompt forward) that ran graphed; ``-`` without any."""
    verifies = sum(row.get(name, 0) for name in VERIFY_COUNTERS)
    return f"{row['graphed_verifies'] / verifies:.0%}" if verifies else "-"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for kind, rows in result["rows"]["resident"].items():
        if kind == "plain":
            continue
        g = [row["draft_tokens"] for row in rows]
        (line,) = left.plot(g, [row["tokens_per_target_forward"] for row in rows], marker="o", label=f"{kind} measured")
        expected = [row["expected_tokens_per_verify"] for row in rows]
        left.plot(g, expected, ls="--", color=line.get_color(), label=f"{kind} (1-a^(g+1))/(1-a)")
    for placement, style in zip(result["rows"], ("-", "--"), strict=False):
        for kind, rows in result["rows"][placement].items():
            if kind == "plain":
                right.axhline(rows[0]["decode_tok_s"], color="black", ls=style, label=f"{placement} plain")
            else:
                g = [row["draft_tokens"] for row in rows]
                right.plot(g, [row["decode_tok_s"] for row in rows], ls=style, marker="o", label=f"{placement} {kind}")
    left.set_xlabel("draft tokens per round g")
    left.set_ylabel("tokens per target forward")
    right.set_xlabel("draft tokens per round g")
    right.set_ylabel("decode tok/s")
    title = f"{result['model'].split('/')[-1]} ({result['dtype']}), {result['machine']['device']}"
    fig.suptitle(f"Speculative decoding: {title}")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = parser_for("speculative", f"{__doc__}\n{speculative_tree.__doc__}")
    parser.add_argument(
        "--drafts",
        default=None,
        help="comma list of copy, bf16, awq, rtn4, earlyN (default copy,bf16,early20; with --tree-budgets the first "
        "one, default awq when gptqmodel is installed, else bf16)",
    )
    parser.add_argument("--draft-lengths", default="1,2,3,4,5,6,7,8", help="comma list of draft tokens per round")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="generations per prompt and row (median tok/s)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--streaming", action="store_true", help="also run with the target's layers streamed")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", help="target: hub name or local model directory (default: the embedded model)")
    which.add_argument("--random-shape", choices=sorted(SHAPES), help="target: random weights of this shape")
    parser.add_argument("--dtype", choices=DTYPES, help="target's dtype (default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--copy-mb", type=int, default=256, help="size of the bandwidth test copies (MB)")
    parser.add_argument(
        "--graphs",
        choices=sorted(GRAPH_ARMS),
        default="auto",
        help="draft engines' graphed verify forwards: auto (on with CUDA), on, off, or both side by side",
    )
    parser.add_argument(
        "--tree-budgets",
        default=None,
        help="comma list of draft tree budgets (0: a chain; auto: the adaptive budget): run the tree benchmark on a "
        "streamed target instead",
    )
    parser.add_argument("--tree-depth", type=int, default=16, help="levels of the draft tree (the chain's length)")
    parser.add_argument("--tree-branching", type=int, default=2, help="children per expanded tree node")
    parser.add_argument(
        "--tree-expansion", choices=TREE_EXPANSIONS, default="level", help="how trees grow (level, global)"
    )
    parser.add_argument(
        "--resident-rows",
        action="store_true",
        help="tree benchmark: decode the plain and fixed-budget rows on the resident target (the same tokens and "
        "forwards), counting the bytes streaming copies per forward; only auto and the verify timing stream",
    )
    args = parser.parse_args(argv)
    if args.tree_budgets is not None:
        budgets: list[int | str] = [n if n == "auto" else int(n) for n in args.tree_budgets.split(",")]
        draft = args.drafts.split(",")[0] if args.drafts else speculative_tree.default_draft()
        target = target_engine(args.model, args.random_shape, args.dtype, args.chunk_size)
        result = speculative_tree.run(target, draft_engine(target, draft), draft, budgets, args.tree_depth,
                                      args.tree_branching, args.prompts, args.max_new_tokens,
                                      max(args.repeats, 3), args.resident_rows, args.tree_expansion)  # fmt: skip
        save_results(args.out, "speculative_tree", result, speculative_tree.report, speculative_tree.plot)
        return 0
    lengths = [int(g) for g in args.draft_lengths.split(",")]
    drafts = (args.drafts or "copy,bf16,early20").split(",")
    result = run(drafts, lengths, args.prompts, args.repeats, args.max_new_tokens, args.chunk_size, args.streaming,
                 model=args.model, random_shape=args.random_shape, dtype=args.dtype, copy_mb=args.copy_mb,
                 graphs=args.graphs)  # fmt: skip
    save_results(args.out, "speculative", result, report, plot)
    return 0
