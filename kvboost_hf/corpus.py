"""Real English text that ships with every Python installation: documentation of standard-library modules.

Benchmarks and demos use it so that nothing is downloaded and the text is not synthetic.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from dataclasses import dataclass
from typing import Any

from kvboost_hf.core.errors import ConfigError

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


def numbered_document(tokenizer: Any, tokens: int) -> str:
    """About ``tokens`` tokens (by ``tokenizer``, a Hugging Face tokenizer) of numbered sections of the
    documentation: a long document that the same question prefix follows (:func:`document_question`)."""
    sources = [text for _, text in documents()]
    parts: list[str] = []
    count = 0
    while count < tokens:
        section = f"Section {len(parts) + 1}.\n{sources[len(parts) % len(sources)]}\n\n"
        parts.append(section)
        count += len(tokenizer(section, add_special_tokens=False)["input_ids"])
    ids = tokenizer("".join(parts), add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def document_question(index: int) -> str:
    """Question ``index`` on a :func:`numbered_document` (distinct per index, one shared prefix)."""
    return f"\n\nQuestion {index}: which section describes the store's tier number {index}, and why?\nAnswer:"


def sample_prompts(count: int = 3) -> list[str]:
    """Prompts of a few hundred tokens built from :func:`documents` (for correctness checks)."""
    return [
        f"{text[:1500]}\n\nQuestion: what is the {title} module for?\nAnswer:" for title, text in documents()[:count]
    ]


_SYSTEM_DOCUMENTS = 3  # documents chat_script's system prompt quotes; each user message quotes one of the rest


def max_chat_turns() -> int:
    """The most turns :func:`chat_script` has a user message for (one per document its system prompt leaves)."""
    return len(documents()) - _SYSTEM_DOCUMENTS


def chat_script(turns: int = 8, system_chars: int = 4000, message_chars: int = 220) -> tuple[str, list[str]]:
    """An agent-style chat: a long system prompt (reference documentation, ~1000 tokens) and ``turns`` short user
    messages, each quoting a little more documentation (~70 tokens), so the context passes 1500 tokens by turn 8
    with 32-token answers. ``turns`` above :func:`max_chat_turns` raises ConfigError (never fewer messages)."""
    messages = [
        f"About the {title} module: {text[:message_chars]}\nWhat is it for, in one sentence?"
        for title, text in documents()[_SYSTEM_DOCUMENTS:]
    ]
    if turns > len(messages):
        raise ConfigError(f"turns must be at most {len(messages)} (one message per document), got {turns}")
    docs = documents(min_chars=system_chars)
    system = (
        "You are a helpful assistant. Answer using this reference.\n\n"
        + "\n\n".join(text for _, text in docs[:_SYSTEM_DOCUMENTS])[:system_chars]
    )
    return system, messages[:turns]


_PLACES = (
    "north archive",
    "river gate",
    "glass tower",
    "old mill",
    "east library",
    "salt warehouse",
    "copper bridge",
    "west observatory",
    "harbour office",
    "stone chapel",
    "signal station",
    "winter garden",
    "clock museum",
    "south depot",
    "paper factory",
    "iron foundry",
    "coral lab",
    "mountain hut",
    "silver vault",
    "lantern hall",
    "cedar school",
    "marble court",
    "canal lock",
    "tea house",
    "weather tower",
    "amber mine",
    "orchard barn",
    "granite quarry",
    "ferry dock",
    "violet theatre",
    "railway yard",
    "pine lodge",
    "brick kiln",
    "tide station",
    "velvet shop",
    "crystal cave",
    "mill pond",
    "hill fort",
    "citrus farm",
    "echo tunnel",
)


@dataclass(frozen=True)
class Fact:
    """A planted fact: ``sentence`` states that the access code of ``place`` is ``answer`` (four digits)."""

    place: str
    answer: str

    @property
    def sentence(self) -> str:
        return f"The access code of the {self.place} is {self.answer}."

    @property
    def question(self) -> str:
        return f"What is the access code of the {self.place}?"


def fact_documents(
    count: int, facts_per_doc: int = 3, chars: int = 1200, seed: int = 0, source_chars: int | None = None
) -> list[tuple[str, list[Fact]]]:
    """``count`` documents of real text (:func:`documents`, about ``chars`` characters each) with
    ``facts_per_doc`` :class:`Fact` sentences planted between paragraphs or sentences, spread over the text.
    The texts are the first of those holding at least ``source_chars`` characters (default ``chars``): the same
    ``source_chars`` gives the same sources cut to every ``chars`` up to it (a document-length sweep).

    Every place appears in one document only and every code is distinct, so each question has one answer.
    Deterministic for a given ``seed`` and Python version.
    """
    sources = documents(min_chars=max(chars, source_chars or chars))
    if count > len(sources) or count * facts_per_doc > len(_PLACES):
        raise ConfigError(
            f"at most {len(sources)} documents and {len(_PLACES)} facts in all, asked for {count} x {facts_per_doc}"
        )
    rng = random.Random(seed)
    places = rng.sample(_PLACES, count * facts_per_doc)
    codes = rng.sample(range(1000, 10000), count * facts_per_doc)
    result = []
    for index, (title, text) in enumerate(sources[:count]):
        body = text[: text.rfind(" ", 0, chars)] if len(text) > chars else text
        facts = [Fact(p, str(c)) for p, c in zip(places[index::count], codes[index::count], strict=True)]
        ends = [m.end() for m in re.finditer(r"[.:]\s", body)] or [len(body)]
        bins = [
            ends[len(ends) * j // facts_per_doc : len(ends) * (j + 1) // facts_per_doc] or ends[-1:]
            for j in range(facts_per_doc)
        ]
        for at, fact in sorted(zip((rng.choice(b) for b in bins), facts, strict=True), key=lambda p: -p[0]):
            body = f"{body[:at]}{fact.sentence} {body[at:]}"
        result.append((f"{title}\n{body}", facts))
    return result
