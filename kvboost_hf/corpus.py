"""Real English text that ships with every Python installation: documentation of standard-library modules.

Benchmarks and demos use it so that nothing is downloaded and the text is not synthetic.
"""

from __future__ import annotations

import importlib
import inspect

_MODULES = (
    "argparse",
    "logging",
    "json",
    "collections",
    "itertools",
    "functools",
    "pathlib",
    "subprocess",
    "threading",
    "asyncio",
    "unittest",
    "dataclasses",
    "typing",
    "re",
    "datetime",
    "heapq",
    "contextlib",
    "csv",
    "sqlite3",
    "shutil",
    "textwrap",
    "enum",
    "decimal",
    "fractions",
    "statistics",
    "random",
)


def documents(min_chars: int = 400) -> list[tuple[str, str]]:
    """``(title, text)`` pairs: module docstrings, extended with their public classes' docstrings until each
    holds at least ``min_chars`` characters. Deterministic for a given Python version."""
    docs = []
    for name in _MODULES:
        module = importlib.import_module(name)
        parts = [inspect.cleandoc(module.__doc__ or "")]
        for attr in sorted(dir(module)):
            if sum(map(len, parts)) >= min_chars:
                break
            obj = getattr(module, attr, None)
            if not attr.startswith("_") and inspect.isclass(obj) and obj.__doc__ and obj.__module__ == name:
                parts.append(inspect.cleandoc(obj.__doc__))
        text = "\n\n".join(p for p in parts if p)
        if len(text) >= min_chars:
            docs.append((name, text))
    return docs


def sample_prompts(count: int = 3) -> list[str]:
    """Prompts of a few hundred tokens built from :func:`documents` (for correctness checks)."""
    return [
        f"{text[:1500]}\n\nQuestion: what is the {title} module for?\nAnswer:" for title, text in documents()[:count]
    ]


def chat_script(turns: int = 8, system_chars: int = 4000, message_chars: int = 220) -> tuple[str, list[str]]:
    """An agent-style chat: a long system prompt (reference documentation, ~1000 tokens) and ``turns`` short user
    messages, each quoting a little more documentation (~70 tokens), so the context passes 1500 tokens by turn 8
    with 32-token answers."""
    docs = documents(min_chars=system_chars)
    system = "You are a helpful assistant. Answer using this reference.\n\n" + "\n\n".join(
        text for _, text in docs[:3]
    )[:system_chars]
    messages = [
        f"About the {title} module: {text[:message_chars]}\nWhat is it for, in one sentence?"
        for title, text in documents()[3 : turns + 3]
    ]
    return system, messages
