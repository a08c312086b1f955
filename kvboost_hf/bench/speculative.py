"""``python -m kvboost_hf.bench speculative``: plain vs speculative decoding side by side, draft lengths 1..8.

The embedded SmolLM2-135M is the target (resident). Drafts that need no second checkpoint:

* ``copy``: a second resident copy of the target (same weights; only worth it when the target's forwards are
  expensive, e.g. streamed: here it costs as much as the target per token);
* ``bf16``: the same weights in bfloat16 (a cheaper, slightly different draft);
* ``earlyN``: the target's own first N layers and head (transformers' ``assistant_early_exit``).

Each prompt is generated greedily (``--max-new-tokens``) once without a draft and once per draft and draft length
``g``, after an untimed warm-up call that stores the prompt's chunks (decode speed, not prefill, is measured).
Reported per row: decode tok/s (tokens after the first step / time after it), target forwards per generated
token, the draft acceptance rate r = accepted / proposed, the per-position acceptance a = P(accept | previous
accepted), the i.i.d. model's tokens per verify (1 - a^(g+1)) / (1 - a) beside the measured tokens per target
forward, and whether the output equals the plain greedy output. Writes ``speculative.json`` and
``speculative.png`` under ``--out``.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from kvboost_hf.bench.common import machine_info, parser_for, save_results
from kvboost_hf.corpus import sample_prompts
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.models import load_model_and_tokenizer
from kvboost_hf.hf.speculative import DraftSettings
from kvboost_hf.results import GenerationResult


def expected_tokens_per_verify(a: float, g: int) -> float:
    """Tokens one verify forward yields when each of ``g`` draft tokens is accepted with probability ``a``
    independently of position, until the first rejection: ``(1 - a^(g+1)) / (1 - a)`` (``g + 1`` at a = 1)."""
    return float(g + 1) if a >= 1.0 else (1.0 - a ** (g + 1)) / (1.0 - a)


def draft_engine(target: InferenceEngine, kind: str) -> InferenceEngine:
    """An engine on the target's model and store with the draft named ``kind`` (copy, bf16 or earlyN)."""
    shared = {"chunk_size": target.chunking.chunk_size, "store": target.store}
    if match := re.fullmatch(r"early(\d+)", kind):
        return InferenceEngine(target.model, target.tokenizer, draft_early_exit=int(match.group(1)), **shared)
    if kind not in ("copy", "bf16"):
        raise ValueError(f"unknown draft {kind!r}: use copy, bf16 or earlyN (N layers of the target)")
    dtype = torch.bfloat16 if kind == "bf16" else target.model.dtype
    draft, _ = load_model_and_tokenizer(None, device=target.device, dtype=dtype)
    return InferenceEngine(target.model, target.tokenizer, draft_model=draft, **shared)


def summarise(results: list[GenerationResult], plain: list[GenerationResult], g: int | None) -> dict:
    """One row: medians over prompts of speed and acceptance, sums of tokens and forwards."""
    tokens = sum(r.generated_tokens for r in results)
    forwards = sum(r.target_forwards for r in results)
    row = {
        "draft_tokens": g,
        "decode_tok_s": statistics.median(r.tokens_per_sec for r in results),
        "target_forwards_per_token": forwards / tokens,
        "tokens_per_target_forward": tokens / forwards,
        "outputs_identical": all(r.output_ids == p.output_ids for r, p in zip(results, plain, strict=True)),
    }
    if g is not None:
        proposed = sum(r.draft_tokens_proposed for r in results)
        accepted = sum(r.draft_tokens_accepted for r in results)
        a = statistics.mean(r.draft_position_acceptance for r in results)
        row.update(
            acceptance_rate=accepted / max(proposed, 1),
            position_acceptance=a,
            expected_tokens_per_verify=expected_tokens_per_verify(a, g),
        )
    return row


def run(drafts: list[str], lengths: list[int], prompts: int, max_new_tokens: int, chunk_size: int) -> dict:
    target = InferenceEngine.from_pretrained(chunk_size=chunk_size)
    texts = sample_prompts(prompts)
    for text in texts:  # store the prompts' chunks; the first call also pays one-time allocator costs
        target.generate(text, max_new_tokens=2)
    plain = [target.generate(text, max_new_tokens=max_new_tokens) for text in texts]
    rows = {"plain": [summarise(plain, plain, None)]}
    for kind in drafts:
        engine = draft_engine(target, kind)
        exit_layers = engine.draft_settings.early_exit_layers
        rows[kind] = []
        for g in tqdm(lengths, desc=f"draft {kind}"):
            engine.draft_settings = DraftSettings(g, early_exit_layers=exit_layers)
            results = [engine.generate(text, max_new_tokens=max_new_tokens) for text in texts]
            rows[kind].append(summarise(results, plain, g))
    return {
        "benchmark": "speculative",
        "machine": machine_info(target.device),
        "model": target.model.config._name_or_path,
        "dtype": str(target.model.dtype),
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "rows": rows,
    }


def report(result: dict) -> str:
    plain = result["rows"]["plain"][0]
    lines = [
        f"plain: {plain['decode_tok_s']:.2f} tok/s, {plain['target_forwards_per_token']:.2f} target forwards/token",
        f"{'draft':>7} {'g':>2} {'tok/s':>7} {'vs plain':>8} {'fwd/tok':>7} {'r':>5} {'a':>5} "
        f"{'tok/verify':>10} {'expected':>8} {'same':>5}",
    ]
    for kind, rows in result["rows"].items():
        if kind == "plain":
            continue
        for row in rows:
            lines.append(
                f"{kind:>7} {row['draft_tokens']:>2} {row['decode_tok_s']:>7.2f} "
                f"{row['decode_tok_s'] / plain['decode_tok_s']:>7.2f}x {row['target_forwards_per_token']:>7.2f} "
                f"{row['acceptance_rate']:>5.2f} {row['position_acceptance']:>5.2f} "
                f"{row['tokens_per_target_forward']:>10.2f} {row['expected_tokens_per_verify']:>8.2f} "
                f"{row['outputs_identical']!s:>5}"
            )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plain = result["rows"]["plain"][0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for kind, rows in result["rows"].items():
        if kind == "plain":
            continue
        g = [row["draft_tokens"] for row in rows]
        (line,) = left.plot(g, [row["tokens_per_target_forward"] for row in rows], marker="o", label=f"{kind} measured")
        left.plot(g, [row["expected_tokens_per_verify"] for row in rows], ls="--", color=line.get_color(),
                  label=f"{kind} (1-a^(g+1))/(1-a)")  # fmt: skip
        right.plot(g, [row["decode_tok_s"] for row in rows], marker="o", label=kind)
    right.axhline(plain["decode_tok_s"], color="black", ls=":", label="plain")
    left.set_xlabel("draft tokens per round g")
    left.set_ylabel("tokens per target forward")
    right.set_xlabel("draft tokens per round g")
    right.set_ylabel("decode tok/s")
    title = f"{result['model'].split('/')[-1]} ({result['dtype']}), {result['machine']['device']}"
    fig.suptitle(f"Speculative decoding, resident target: {title}")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = parser_for("speculative", __doc__)
    parser.add_argument("--drafts", default="copy,bf16,early20", help="comma list of copy, bf16, earlyN")
    parser.add_argument("--draft-lengths", default="1,2,3,4,5,6,7,8", help="comma list of draft tokens per round")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=64)
    args = parser.parse_args(argv)
    lengths = [int(g) for g in args.draft_lengths.split(",")]
    result = run(args.drafts.split(","), lengths, args.prompts, args.max_new_tokens, args.chunk_size)
    save_results(args.out, "speculative", result, report, plot)
    return 0
