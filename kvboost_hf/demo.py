"""``python -m kvboost_hf.demo``: a multi-turn chat on the embedded model, cold vs warm TTFT per turn.

Each turn runs twice on the same conversation: a full prefill (cold: no reuse) and kvboost_hf (warm:
the system prompt and all previous turns come from the chunk store). Prints a row per turn, then a short
summary; ``--stats-json FILE`` saves the engine's full store and decode counters as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.corpus import chat_script, max_chat_turns
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.results import GenerationResult


@dataclass(frozen=True)
class Turn:
    """One turn of the demo: the same conversation generated cold (no reuse) and warm (chunk reuse)."""

    cold: GenerationResult
    warm: GenerationResult

    @property
    def same_output(self) -> bool:
        return self.cold.output_ids == self.warm.output_ids


def summary(turns: list[Turn]) -> list[str]:
    """The closing lines: median TTFT cold vs warm over the turns that had something cached (every turn but the
    first; all turns when there is only one), the speed-up, the last turn's cached prompt tokens and how many
    turns gave identical output. TTFT in milliseconds."""
    reused = turns[1:] or turns
    cold_ms = statistics.median(turn.cold.ttft_ms for turn in reused)
    warm_ms = statistics.median(turn.warm.ttft_ms for turn in reused)
    last = turns[-1].warm
    which = "turn 1" if len(turns) == 1 else f"turns 2-{len(turns)}"
    return [
        f"TTFT, median of {which}: cold {cold_ms:.0f} ms, warm {warm_ms:.0f} ms ({cold_ms / warm_ms:.1f}x faster)",
        f"last turn: {last.cached_tokens} of {last.prompt_tokens} prompt tokens loaded from the store "
        f"({last.kv_reuse_ratio:.0%})",
        f"outputs identical cold vs warm: {sum(turn.same_output for turn in turns)} of {len(turns)} turns",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local directory or hub name (default: embedded model)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--chunk-size", type=int, default=ChunkingConfig.chunk_size)
    parser.add_argument("--stats-json", type=Path, default=None, help="write the engine's counters to this file")
    args = parser.parse_args(argv)
    for flag, value in (
        ("--turns", args.turns),
        ("--max-new-tokens", args.max_new_tokens),
        ("--chunk-size", args.chunk_size),
    ):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.turns > (max_turns := max_chat_turns()):
        parser.error(f"--turns must be at most {max_turns} (the demo's chat has that many messages), got {args.turns}")
    if args.stats_json is not None and not args.stats_json.parent.is_dir():
        parser.error(f"--stats-json: no directory {args.stats_json.parent} to write {args.stats_json.name} in")
    if args.stats_json is not None and args.stats_json.is_dir():
        parser.error(f"--stats-json must name a file, got the directory {args.stats_json}")
    logging.basicConfig(level=logging.WARNING)

    engine = InferenceEngine.from_pretrained(args.model, chunking=args.chunk_size)
    system, user_messages = chat_script(args.turns)
    messages = [{"role": "system", "content": system}]
    print(
        f"{'turn':>4} {'prompt tok':>10} {'cold TTFT ms':>12} {'warm TTFT ms':>12} {'speed-up':>8} "
        f"{'reused':>7} {'same output':>11}"
    )
    turns: list[Turn] = []
    for number, text in enumerate(user_messages, start=1):
        messages.append({"role": "user", "content": text})
        cold = engine.generate(messages, max_new_tokens=args.max_new_tokens, mode="baseline")
        warm = engine.generate(messages, max_new_tokens=args.max_new_tokens)
        turn = Turn(cold, warm)
        turns.append(turn)
        print(
            f"{number:>4} {warm.prompt_tokens:>10} {cold.ttft_ms:>12.0f} {warm.ttft_ms:>12.0f} "
            f"{cold.ttft_ms / warm.ttft_ms:>7.1f}x {warm.kv_reuse_ratio:>6.0%} {turn.same_output!s:>11}"
        )
        messages.append({"role": "assistant", "content": warm.output_text})
    print(f"\nlast answer: {messages[-1]['content']!r}\n")
    print("\n".join(summary(turns)))
    if args.stats_json is not None:
        args.stats_json.write_text(json.dumps(engine.cache_stats(), indent=2, sort_keys=True) + "\n")
        print(f"store and decode counters: {args.stats_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
