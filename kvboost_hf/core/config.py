"""Settings shared by every stage: what reuse a generation may use and how approximate hits are repaired."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvboost_hf.core.errors import ConfigError
from kvboost_hf.core.values import is_finite, is_integer

#: Whether a step runs every batch's decode step and the next chunks of its prompts under way as one packed forward
#: where the model's attention allows (:meth:`~kvboost_hf.runner.ModelRunner.execute`) unless the caller says
#: otherwise (``ServerConfig.pack_forwards``, the engine's ``core``, ``ModelRunner``'s ``pack_forwards``): the one
#: place this default is written.
DEFAULT_PACK_FORWARDS = True

#: Rows running at once unless the caller says otherwise (``ServerConfig.max_batch_size``, the engine's
#: ``generate_many`` and ``core``, ``Scheduler``'s ``max_rows``): the one place this default is written.
DEFAULT_MAX_BATCH_SIZE = 8

#: Tokens one scheduler step computes at most unless the caller says otherwise (``ServerConfig.token_budget``, the
#: engine's ``generate_many`` and ``core``, ``Scheduler``'s ``token_budget``): the one place this default is
#: written. 0 means no budget.
DEFAULT_TOKEN_BUDGET = 2048


def unknown_member(enum: type[Enum], value: object) -> ConfigError:
    """The error for a ``value`` that names no member of ``enum``, listing the values it takes."""
    names = ", ".join(repr(member.value) for member in enum)
    return ConfigError(f"{enum.__name__} must be one of {names}, got {value!r}")


class GenerationMode(str, Enum):
    """What reuse a generation may use. The values are the setting's one spelling, wherever it is given (the
    engine's ``mode=``, the server's ``--reuse-mode``); the server's former spellings are still accepted:
    ``GenerationMode("prefix")`` is ``PREFIX_CACHE`` (:data:`GENERATION_MODE_ALIASES`)."""

    BASELINE = "baseline"  # plain generate(), no lookups, no write-back
    PREFIX_CACHE = "prefix_cache"  # exact prefix hits only
    CHUNK_KV_REUSE = "chunk_kv_reuse"  # everything enabled: also content-key hits, repaired

    @classmethod
    def _missing_(cls, value: object) -> GenerationMode:
        """A former spelling's mode; :class:`ConfigError` naming the modes for anything else."""
        mode = GENERATION_MODE_ALIASES.get(value) if isinstance(value, str) else None
        if mode is None:
            raise unknown_member(cls, value)
        return mode


#: The server's former ``--reuse-mode`` spellings, accepted wherever a mode is given: old spelling -> mode.
GENERATION_MODE_ALIASES = {
    "off": GenerationMode.BASELINE,
    "prefix": GenerationMode.PREFIX_CACHE,
    "chunk": GenerationMode.CHUNK_KV_REUSE,
}


class RecomputeStrategy(str, Enum):
    """How stitched K/V that missed their real preceding context are repaired.

    Exact prefix hits never need repair; these strategies apply to non-prefix (content-key) hits.
    """

    NONE = "none"
    SELECTIVE = "selective"
    CACHEBLEND = "cacheblend"

    @classmethod
    def _missing_(cls, value: object) -> RecomputeStrategy:
        """:class:`ConfigError` naming the strategies."""
        raise unknown_member(cls, value)


@dataclass(frozen=True)
class RepairConfig:
    """Knobs of the repair of approximate (content-key) hits. ``ratio`` is a share of the reused tokens.

    Attributes:
        context_temperature: APE attention temperature T on the reused documents for every later query (1: off)
        context_scale: APE scaling factor S of the reused documents' attention mass for every later query (1: off)
    """

    strategy: RecomputeStrategy | str = RecomputeStrategy.SELECTIVE  # a name is turned into the enum
    ratio: float = 0.15
    check_layer: int = 1
    overlap_k: int = 2
    sink_tokens: int = 0
    head_tokens: int = 0  # recompute the first tokens of every reused chunk at every layer (EPIC-style)
    filter_layers: int = 0  # CacheBlend: layers after check_layer over which the recomputed share shrinks
    deviation: str = "key"  # CacheBlend: which fresh-vs-stored deviation ranks tokens: "key" or "value"
    # APE-style attention adjustment of every later query over the approximate (content-key) columns: T divides
    # their logits, S sets their softmax mass to exp(S * T * logsumexp(logits / T)). Both 1.0: plain attention.
    # Needs attn_implementation="kvboost" (an engine whose default repair sets them switches its model to it).
    context_temperature: float = 1.0
    context_scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", RecomputeStrategy(self.strategy))
        if not (is_finite(self.ratio) and 0.0 <= self.ratio <= 1.0):
            raise ConfigError(f"recompute_ratio must be a number in [0, 1], got {self.ratio!r}")
        counts = {
            "check_layer": self.check_layer,
            "overlap_k": self.overlap_k,
            "sink_tokens": self.sink_tokens,
            "head_tokens": self.head_tokens,
            "filter_layers": self.filter_layers,
        }
        for name, count in counts.items():
            if not (is_integer(count) and count >= 0):
                raise ConfigError(f"RepairConfig.{name} must be a whole number >= 0, got {count!r}")
        if self.deviation not in ("key", "value"):
            raise ConfigError(f"deviation must be 'key' or 'value', got {self.deviation!r}")
        if not all(is_finite(v) and v > 0.0 for v in (self.context_temperature, self.context_scale)):
            raise ConfigError(
                f"context_temperature and context_scale must be finite and > 0, got {self.context_temperature!r} and "
                f"{self.context_scale!r}"
            )

    @property
    def adjusts_attention(self) -> bool:
        """Whether later queries attend to approximate columns with the APE-style adjustment."""
        return (self.context_temperature, self.context_scale) != (1.0, 1.0)
