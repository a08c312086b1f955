"""``python -m kvboost_hf.demo``: a multi-turn chat on the embedded model, cold vs warm TTFT per turn.

Each turn runs twice on the same conversation: a full prefill (cold: no reuse) and kvboost_hf (warm:
the system prompt and all previous turns come from the chunk store). Prints a table; the answers are equal.
"""

from __future__ import annotations

import argparse
import logging

from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.corpus import chat_script
from kvboost_hf.engine import InferenceEngine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local directory or hub name (default: embedded model)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--chunk-size", type=int, default=ChunkingConfig.chunk_size)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    engine = InferenceEngine.from_pretrained(args.model, chunking=args.chunk_size)
    system, user_messages = chat_script(args.turns)
    messages = [{"role": "system", "content": system}]
    print(
        f"{'turn':>4} {'prompt tok':>10} {'cold TTFT ms':>12} {'warm TTFT ms':>12} {'speed-up':>8} "
        f"{'reused':>7} {'same output':>11}"
    )
    for turn, text in enumerate(user_messages, start=1):
        messages.append({"role": "user", "content": text})
        cold = engine.generate(messages, max_new_tokens=args.max_new_tokens, mode="baseline")
        warm = engine.generate(messages, max_new_tokens=args.max_new_tokens)
        print(
            f"{turn:>4} {warm.prompt_tokens:>10} {cold.ttft_ms:>12.0f} {warm.ttft_ms:>12.0f} "
            f"{cold.ttft_ms / warm.ttft_ms:>7.1f}x {warm.kv_reuse_ratio:>6.0%} "
            f"{cold.output_ids == warm.output_ids!s:>11}"
        )
        messages.append({"role": "assistant", "content": warm.output_text})
    print(f"\nlast answer: {messages[-1]['content']!r}")
    print(f"store: {engine.cache_stats()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
