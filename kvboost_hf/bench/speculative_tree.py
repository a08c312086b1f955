"""``python -m kvboost_hf.bench speculative --tree-budgets 0,4,16,64``: draft trees on a streamed target.

The embedded SmolLM2-135M is the target with all its decoder layers but the first and the last streamed
(:mod:`kvboost_hf.offload`): every target forward copies 28 of 30 layers. The draft is its int4 copy (``awq``, when
gptqmodel is installed) or its bfloat16 copy, resident. Each prompt is decoded greedily without a draft (plain
streaming), then once per tree budget ``N`` (``N = 0``: a chain of ``--tree-depth`` tokens, the chain draft; else a
tree of ``N`` nodes, ``--tree-depth`` levels deep, ``--tree-branching`` children per node), all in one run after an
untimed warm-up call per prompt and model; ``auto`` in the list is the adaptive budget
(``DraftConfig.adaptive_tree_budget``, at most the largest budget given, else 256). Reported per row: tokens per
target forward (prefill included; with a draft the prompt forward verifies the first tree) and per verify forward,
streamed bytes per generated token and their ratio to plain streaming, draft forwards per token, the acceptance per
draft depth (:func:`~kvboost_hf.hf.speculative.acceptance_by_depth`), CPU decode tok/s (one run on a shared
machine: indicative only), and where the output first differs from plain greedy (``same``: ``=`` when every output
equals plain greedy's, else ``@k``, the earliest generated token at which one differs); for ``auto``, the fitted
verify cost and the budget it chose.

Also measured: the cost of one streamed verify forward over ``n`` tree nodes on this machine (median of
``--repeats`` forwards at the first prompt's length, ``n`` = 1 and each budget + 1), and its cost per node.

The GPU figure is an ESTIMATE, not a measurement: ``H2D bandwidth / streamed bytes per generated token`` for PCIe
4.0 and 5.0 x16 (about 25 and 50 GB/s in practice), i.e. the copy bound alone; it ignores the verify's compute and
the draft's forwards (see their count per token), so a GPU would reach less.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel

from kvboost_hf.bench.common import agreement_label, earliest_difference, first_difference, machine_info, pyplot
from kvboost_hf.corpus import sample_prompts
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.decode import DecodeRequest
from kvboost_hf.hf.models import model_dtype
from kvboost_hf.hf.prefill import forward
from kvboost_hf.hf.sampling import SamplingConfig
from kvboost_hf.hf.speculative import DraftConfig, acceptance_by_depth, tree_attention_mask
from kvboost_hf.offload import LayerStreamingConfig, enable_layer_streaming, layer_streamer
from kvboost_hf.scheduling import RequestGroup

PCIE_GB_S = {"pcie4_x16": 25.0, "pcie5_x16": 50.0}  # practical host-to-device bandwidths (estimate inputs)
AUTO_CAP = 256  # the adaptive row's largest budget when no fixed budget is given


def default_draft() -> str:
    """``awq`` (the int4 copy) when gptqmodel can load it, else ``bf16``."""
    return "awq" if importlib.util.find_spec("gptqmodel") is not None else "bf16"


def decode_once(engine: InferenceEngine, text: str, max_new_tokens: int) -> dict[str, Any]:
    """Decode ``text`` greedily on ``engine``'s loop (its draft settings as they are) and return its counts."""
    request = DecodeRequest(
        prompt_ids=engine.encode(text), max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature=0)
    )
    core = engine.core(max_batch_size=1)
    group = RequestGroup(engine.factories.new_rows([request]))
    core.scheduler.add(group)
    with engine.lock:
        started = time.perf_counter()
        core.run()
        seconds = time.perf_counter() - started
    (row,) = group.rows
    assert group.batch is not None and group.batch.decode_counts is not None, "the request ran"
    counts = group.batch.decode_counts
    return {
        "tokens": row.tokens,
        "target_forwards": counts["target_forwards"],
        "verify_forwards": counts["verify_forwards"],
        "draft_forwards": counts["draft_forwards"],
        "streamed_bytes": counts["streamed_bytes"] or 0,
        "proposed": row.draft_proposed,
        "accepted": row.draft_accepted,
        "rounds": row.draft_rounds,
        "seconds": seconds,
    }


def summarise(runs: list[dict[str, Any]], plain: list[dict[str, Any]], budget: int | str | None) -> dict[str, Any]:
    """One row from the runs of every prompt: sums of tokens, forwards and bytes, acceptance per depth."""
    tokens = sum(len(run["tokens"]) for run in runs)
    forwards = sum(run["target_forwards"] for run in runs)
    verifies = sum(run["verify_forwards"] for run in runs)
    streamed = sum(run["streamed_bytes"] for run in runs)
    plain_bytes_per_token = sum(run["streamed_bytes"] for run in plain) / sum(len(run["tokens"]) for run in plain)
    rounds = [entry for run in runs for entry in run["rounds"]]
    accepted, rejected = sum(kept for kept, _ in rounds), sum(refused for _, refused in rounds)
    by_depth = acceptance_by_depth(rounds)
    return {
        "tree_budget": budget,
        "generated_tokens": tokens,
        "target_forwards": forwards,
        "tokens_per_target_forward": tokens / forwards,
        "tokens_per_verify": 1 + accepted / verifies if verifies else None,  # its own token + accepted ones
        "nodes_per_verify": sum(run["proposed"] for run in runs) / verifies if verifies else None,
        "draft_forwards_per_token": sum(run["draft_forwards"] for run in runs) / tokens,
        "streamed_mb_per_token": streamed / tokens / 1e6,
        "streamed_vs_plain": streamed / tokens / plain_bytes_per_token,
        "acceptance_by_depth": by_depth,
        "position_acceptance": accepted / max(accepted + rejected, 1) if budget is not None else None,
        "cpu_tok_s": tokens / sum(run["seconds"] for run in runs),
        "estimated_gpu_tok_s": {link: gb_s * 1e9 * tokens / streamed for link, gb_s in PCIE_GB_S.items()},
        "first_difference": earliest_difference(
            [first_difference(run["tokens"], base["tokens"]) for run, base in zip(runs, plain, strict=True)]
        ),
    }


def adaptive_choice(engine: InferenceEngine) -> dict[str, Any]:
    """What the adaptive budget saw on ``engine``: its fit of the timed verify forwards and the budget it would
    choose next for one row."""
    fit = engine.verify_costs.fit()
    return {
        "timed_verifies": len(engine.verify_costs.samples),
        "fixed_seconds": None if fit is None else fit[0],
        "seconds_per_node": None if fit is None else fit[1],
        "next_budget": engine.draft_settings.adaptive_budget(engine.verify_costs, rows=1),
    }


@torch.no_grad()
def draft_ranks(target: PreTrainedModel, draft: PreTrainedModel, prompt_ids: list[int], tokens: list[int]) -> dict:
    """Teacher-forced over the prompt and the target's greedy ``tokens``: at each generated position, the rank
    (1 = the draft's argmax) of the target's token among the draft's predictions, and the draft's top probability
    there. Two forwards, no cache: what the draft misses, independent of how rounds fall."""
    sequence = torch.tensor([[*prompt_ids, *tokens]], device=next(target.parameters()).device)
    start = len(prompt_ids) - 1  # the logits at position i predict token i + 1
    logits = draft(sequence).logits[0, start:-1].float()
    chosen = torch.tensor(tokens, device=logits.device)
    ranks = (logits > logits.gather(1, chosen[:, None])).sum(1) + 1
    confident = logits.softmax(-1).amax(-1)
    target_logits = target(sequence).logits[0, start:-1]
    return {
        "ranks": ranks.tolist(),
        "draft_top_probability": confident.tolist(),
        "target_agrees": (target_logits.argmax(-1) == chosen).tolist(),  # greedy replayed (numerics check)
    }


def draft_visibility(size: int, branching: int | None = None) -> torch.Tensor:
    """Boolean ``[size, size]``: node ``i`` sees node ``j`` (itself and its ancestors). ``branching`` None: a chain
    (node ``i``'s parent is ``i - 1``); else a complete tree in breadth-first order (parent ``(i - 1) //
    branching``)."""
    visible = torch.eye(size, dtype=torch.bool)
    for node in range(1, size):
        parent = node - 1 if branching is None else (node - 1) // branching
        visible[node] |= visible[parent]
    return visible


def time_verify_forwards(
    model: PreTrainedModel, prompt_ids: list[int], sizes: list[int], repeats: int, branching: int | None = None
) -> dict:
    """Median seconds of one target forward over ``n`` new positions after the prompt, per ``n`` in ``sizes``: a
    draft of ``n`` nodes shaped by :func:`draft_visibility` (default a chain, whose 4D mask costs what a tree's
    does); the cache is cropped back after each forward. On CUDA each forward is timed to its completion."""
    device = next(model.parameters()).device
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], device=device)
    forward(model, cache, input_ids=ids, logits_to_keep=1)
    context = torch.ones(1, len(prompt_ids), dtype=torch.long, device=device)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    seconds = {}
    for size in sizes:
        visible = draft_visibility(size, branching)
        mask = tree_attention_mask(context, visible[None], model_dtype(model))
        positions = (len(prompt_ids) - 1 + visible.sum(1)).to(device)[None]  # the prompt's length + depth
        fed = torch.randint(0, vocab, (1, size), device=device)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            forward(model, cache, input_ids=fed, attention_mask=mask, position_ids=positions, logits_to_keep=size)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
            cache.crop(-size)
        seconds[size] = statistics.median(times)
    return seconds


def run(
    target: InferenceEngine,
    drafted: InferenceEngine,
    draft: str,
    budgets: list[int | str],
    depth: int,
    branching: int,
    prompts: int,
    max_new_tokens: int,
    repeats: int,
    resident: bool = False,
    expansion: str = "level",
) -> dict[str, Any]:
    """Plain streaming, then one row per budget, on ``target`` (resident until here; streamed from now on) and
    ``drafted`` (an engine on the same model with the draft named ``draft``); ``repeats`` timed verify forwards.
    ``resident``: decode the plain and fixed-budget rows before streaming starts (the same tokens and forwards:
    streaming is exact; much faster on a CPU) and count for each of their target forwards the bytes streaming
    copies per forward (their CPU tok/s is then the resident target's); the ``auto`` row always runs streamed,
    since it times the verify forwards it adapts to."""
    texts = sample_prompts(prompts)
    for engine in (target, drafted):  # untimed, resident: stores the prompts' chunks, pays one-time costs
        for text in texts:
            engine.generate(text, max_new_tokens=4)
    fixed_budgets = [budget for budget in budgets if isinstance(budget, int)]
    largest = max(fixed_budgets, default=0) or AUTO_CAP

    def decode_row(budget: int | str | None) -> list[dict[str, Any]]:
        engine, adaptive = (target, False) if budget is None else (drafted, budget == "auto")
        if budget is not None:
            drafted.draft_settings = DraftConfig(depth, tree_budget=largest if adaptive else int(budget),
                                                   tree_branching=branching, tree_expansion=expansion,
                                                   adaptive_tree_budget=adaptive)  # fmt: skip
        return [decode_once(engine, text, max_new_tokens) for text in texts]

    early = [None, *fixed_budgets] if resident else []
    runs = {budget: decode_row(budget) for budget in tqdm(early, desc=f"resident rows, draft {draft}")}
    enable_layer_streaming(target.model, LayerStreamingConfig(keep_first_k=1, keep_last_k=1))
    streamer = layer_streamer(target.model)
    assert streamer is not None, "streaming was just enabled"
    for row_runs in runs.values():  # what streaming copies for each of their target forwards
        for run_ in row_runs:
            run_["streamed_bytes"] = run_["target_forwards"] * streamer.stats(settle=False).bytes_per_forward
    for budget in tqdm([b for b in [None, *budgets] if b not in runs], desc=f"streamed rows, draft {draft}"):
        runs[budget] = decode_row(budget)
    plain = runs[None]
    rows = [summarise(plain, plain, None)]
    for budget in budgets:
        rows.append(summarise(runs[budget], plain, budget))
        if budget == "auto":
            rows[-1]["adaptive"] = adaptive_choice(drafted)
    draft_model = drafted.draft_model
    ranks = None if draft_model is None else draft_ranks(target.model, draft_model, target.encode(texts[0]),
                                                         plain[0]["tokens"])  # fmt: skip
    sizes = sorted({1, *(budget + 1 for budget in fixed_budgets if budget), depth + 1})
    seconds = time_verify_forwards(target.model, target.encode(texts[0]), sizes, repeats)
    stats = streamer.stats()
    return {
        "benchmark": "speculative_tree",
        "machine": machine_info(target.device),
        "model": target.model.config._name_or_path,
        "dtype": str(target.model.dtype),
        "draft": draft,
        "tree_depth": depth,
        "tree_branching": branching,
        "tree_expansion": expansion,
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "resident_rows": resident,
        "streamed_layers": stats.streamed_layers,
        "streamed_mb_per_forward": stats.bytes_per_forward / 1e6,
        "pcie_gb_s": PCIE_GB_S,
        "rows": rows,
        "draft_ranks_first_prompt": ranks,
        "verify_seconds": {str(size): value for size, value in seconds.items()},
        "verify_ms_per_node": 1e3 * (seconds[sizes[-1]] - seconds[1]) / max(sizes[-1] - 1, 1),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(result: dict[str, Any]) -> str:
    lines = [
        f"streamed target: {result['streamed_layers']} layers, {result['streamed_mb_per_forward']:.0f} MB per forward;"
        f" draft {result['draft']}, depth {result['tree_depth']}, branching {result['tree_branching']},"
        f" expansion {result.get('tree_expansion', 'level')};"
        f" {result['prompts']} prompts x {result['max_new_tokens']} new tokens, greedy",
        f"{'budget':>7} {'tok/fwd':>7} {'tok/verify':>10} {'nodes/verify':>12} {'MB/tok':>6} {'vs plain':>8} "
        f"{'draft fwd/tok':>13} {'a':>5} {'CPU tok/s':>9} {'GPU est. tok/s (PCIe4/5)':>24} {'same':>5}",
    ]
    for row in result["rows"]:
        budget = "plain" if row["tree_budget"] is None else ("chain" if row["tree_budget"] == 0 else row["tree_budget"])
        estimate = row["estimated_gpu_tok_s"]
        lines.append(
            f"{budget!s:>7} {row['tokens_per_target_forward']:>7.2f} {_fmt(row['tokens_per_verify'], '.2f'):>10} "
            f"{_fmt(row['nodes_per_verify'], '.1f'):>12} {row['streamed_mb_per_token']:>6.0f} "
            f"{row['streamed_vs_plain']:>7.2f}x {row['draft_forwards_per_token']:>13.2f} "
            f"{_fmt(row['position_acceptance'], '.2f'):>5} {row['cpu_tok_s']:>9.2f} "
            f"{estimate['pcie4_x16']:>11.0f} / {estimate['pcie5_x16']:<10.0f} "
            f"{agreement_label(row['first_difference']):>5}"
        )
    lines.append("acceptance per draft depth (1, 2, ...):")
    for row in result["rows"][1:]:
        rates = " ".join(f"{rate:.2f}" for rate in row["acceptance_by_depth"])
        lines.append(f"  budget {row['tree_budget']:>3}: {rates}")
    for row in result["rows"]:
        if "adaptive" in row:
            choice = row["adaptive"]
            lines.append(
                f"  auto: {choice['timed_verifies']} timed verifies, fixed {_fmt(choice['fixed_seconds'], '.3f')}"
                f" s + {_fmt(choice['seconds_per_node'], '.2e')} s per node -> budget {choice['next_budget']}"
            )
    ranks = result.get("draft_ranks_first_prompt")
    if ranks:
        pattern = "".join(str(rank) if rank < 10 else "+" for rank in ranks["ranks"])
        lines.append(f"draft rank of the target's greedy token, teacher-forced, prompt 1 (+: >= 10): {pattern}")
    verify = ", ".join(f"{size} nodes {1e3 * s:.0f} ms" for size, s in result["verify_seconds"].items())
    lines.append(f"streamed verify forward on this machine: {verify}; {result['verify_ms_per_node']:.2f} ms per node")
    lines.append("GPU tok/s: ESTIMATE = PCIe bandwidth / streamed bytes per token (copy bound; no compute, no draft)")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    trees = [row for row in result["rows"] if row["tree_budget"] is not None]
    labels = [str(row["tree_budget"]) if row["tree_budget"] else "chain" for row in trees]
    left.bar(labels, [row["tokens_per_target_forward"] for row in trees])
    left.axhline(result["rows"][0]["tokens_per_target_forward"], color="black", ls="--", label="plain streaming")
    left.set_ylabel("tokens per target forward")
    middle.bar(labels, [row["streamed_vs_plain"] for row in trees])
    middle.set_ylabel("streamed bytes per token / plain streaming")
    for row, label in zip(trees, labels, strict=True):
        right.plot(range(1, len(row["acceptance_by_depth"]) + 1), row["acceptance_by_depth"], marker=".", label=label)
    right.set_xlabel("draft depth")
    right.set_ylabel("acceptance at depth | reached")
    for ax in (left, middle):
        ax.set_xlabel(f"tree budget (depth {result['tree_depth']}, branching {result['tree_branching']})")
    for ax in (left, middle, right):
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.suptitle(f"Tree speculation, streamed {result['model'].split('/')[-1]}, draft {result['draft']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
