"""Server settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvboost_hf.core.config import DEFAULT_MAX_BATCH_SIZE, DEFAULT_PACK_FORWARDS, DEFAULT_TOKEN_BUDGET, GenerationMode
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.core.values import check_bounds
from kvboost_hf.hf.chat_segments import DocumentBoundaries
from kvboost_hf.kv_budget import check_budget_setting
from kvboost_hf.server.grammar import GrammarConfig

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"  # the model id the server reports for the embedded model


@dataclass(frozen=True)
class ServerConfig:
    """Server behaviour (every field is a ``kvboost-hf serve`` flag, see :mod:`kvboost_hf.server.launch`).

    Attributes:
        model_name: the model id clients send and responses carry.
        api_key: required Bearer key (None: no authentication).
        reuse_mode: a :class:`~kvboost_hf.core.config.GenerationMode` value: ``baseline`` (plain K/V per request),
            ``prefix_cache`` (exact prefix hits: outputs equal no reuse, batched or alone) or ``chunk_kv_reuse``
            (also repaired non-prefix hits: approximate, prefilled alone). The former spellings ``off``,
            ``prefix``, ``chunk`` are accepted and stored as these.
        batch_window_ms: how long a tenant's oldest waiting request waits for others before a new batch forms (ms).
        max_batch_size: rows generated at once.
        token_budget: tokens one scheduler step computes at most: the running rows' decode steps first, then chunks
            of joining prompts, so a long prompt never pauses the running streams for its whole prefill (0: no
            budget, each prompt prefilled in one forward; else >= max_batch_size).
        pack_forwards: run every batch's decode step and the next chunks of its joining prompts as one forward
            where the model's attention allows (the kvboost attention: the default on the CPU), reading the weights
            once per step; off: a forward per batch step and per chunk.
        kv_budget_bytes: bytes of K/V the running requests may hold: a request waits while its prompt and
            max_tokens would not fit, and the newest requests are preempted (their K/V stored, resumed from the
            store with the same tokens) when the batch outgrows it; one that cannot fit alone is refused (None:
            derived from the free device memory on CUDA, none on CPU; 0: none).
        max_queue: requests waiting before 429.
        default_max_tokens: budget when a request names none.
        max_tokens_limit: largest budget a request may ask for (None: up to the context).
        shutdown_grace_s: time in-flight requests get to finish at shutdown before they are ended (streams with
            a final chunk, others with an error body).
        max_body_bytes: largest request body (413 beyond, checked before the body is parsed).
        max_json_values: most JSON values (objects, arrays, strings, numbers...) a body may hold (400 beyond,
            counted in a thread before validation, which runs on the event loop).
        header_timeout_s: time a client gets to send a request's headers, from connecting or from the end of its
            previous response (the connection is answered 408 and closed after), in seconds.
        body_timeout_s: time a request's whole body may take to arrive after its headers (408 after), in seconds.
        max_connections_per_client: open connections per client address, 0: no cap (429 beyond).
            Behind a reverse proxy all clients share its address: raise it there.
        max_warm_documents: most documents one /v1/warm request may store (400 beyond).
        document_boundaries: which chat contents start documents for non-prefix reuse with reuse_mode chunk_kv_reuse
            (parts: each text part of a message with several; messages: also each message's content; none), unless
            a request names its own (see :mod:`kvboost_hf.hf.chat_segments`).
        warm_up_graphs: graphs compiled at start, comma separated (e.g. 1x4096,8x4096,1x4096x64,1x4096v4).
            Each shape is batch rows x cache tokens for a decode step, with x new tokens for the prompt forward of a
            warm chat turn (its tail after reused K/V) or v draft tokens per row for a speculative verify forward
            (with a draft model), rounded up to the graph buckets; /health's decode_graphs says
            warming, then ready; requests arriving meanwhile wait. Empty: each shape compiles at its first step.
        grammar_limits: bounds of structured output and tool-call constraints (schema size: 400 beyond; compiles
            waiting: 503 beyond; compile wait: 503 after).
    """

    model_name: str = EMBEDDED_MODEL_NAME
    api_key: str | None = None
    reuse_mode: str = GenerationMode.PREFIX_CACHE.value
    batch_window_ms: float = 10.0
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    token_budget: int = DEFAULT_TOKEN_BUDGET
    pack_forwards: bool = DEFAULT_PACK_FORWARDS
    kv_budget_bytes: int | None = None
    max_queue: int = 64
    default_max_tokens: int = 256
    max_tokens_limit: int | None = None
    shutdown_grace_s: float = 10.0
    max_body_bytes: int = 4 << 20
    max_json_values: int = 20_000
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections_per_client: int = 128
    max_warm_documents: int = 256
    document_boundaries: str = DocumentBoundaries.PARTS.value
    warm_up_graphs: str = ""
    grammar_limits: GrammarConfig = field(default_factory=GrammarConfig)

    def __post_init__(self) -> None:
        try:
            mode = GenerationMode(self.reuse_mode)
        except ValueError:
            names = [mode.value for mode in GenerationMode]
            raise ConfigError(f"reuse_mode must be one of {names}, got {self.reuse_mode!r}") from None
        object.__setattr__(self, "reuse_mode", mode.value)  # a former spelling is stored as the mode's value
        if self.max_batch_size < 1 or self.max_queue < 1:
            raise ConfigError(
                f"max_batch_size and max_queue must be >= 1, got {self.max_batch_size} and {self.max_queue}"
            )
        if self.token_budget < 0 or 0 < self.token_budget < self.max_batch_size:
            raise ConfigError(
                f"token_budget must be 0 (none) or >= max_batch_size={self.max_batch_size}, got {self.token_budget}"
            )
        check_budget_setting(self.kv_budget_bytes)
        check_bounds(
            "ServerConfig",
            [
                ("batch_window_ms", self.batch_window_ms, 0, False),
                ("default_max_tokens", self.default_max_tokens, 1, False),
                ("max_tokens_limit", self.max_tokens_limit, 1, False),
                ("shutdown_grace_s", self.shutdown_grace_s, 0, False),
                ("max_body_bytes", self.max_body_bytes, 1, False),
                ("max_json_values", self.max_json_values, 1, False),
                ("header_timeout_s", self.header_timeout_s, 0, True),
                ("body_timeout_s", self.body_timeout_s, 0, True),
                ("max_connections_per_client", self.max_connections_per_client, 0, False),
                ("max_warm_documents", self.max_warm_documents, 1, False),
            ],
        )
