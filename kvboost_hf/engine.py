"""The engine facade: one object that owns a model, its tokenizer and a chunk store.

``KVBoost`` (this module's :class:`InferenceEngine`) delegates to its parts: a prompt encoder
(:mod:`kvboost_hf.hf.prompts`), the warm path (:mod:`kvboost_hf.hf.warm`) and the factories of caches, decode loops,
drafters and engine cores (:mod:`kvboost_hf.factories`). ``generate``, ``generate_batch`` and ``generate_many``
share one path: their options become a :class:`GenerateOptions`, each prompt one row queued on a fresh engine core
(:class:`~kvboost_hf.engine_core.EngineCore`: a scheduler and a model runner, what the server runs) stepped until
every row finished; each result reports time to first token and reuse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.core.config import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_PACK_FORWARDS,
    DEFAULT_TOKEN_BUDGET,
    GenerationMode,
    RepairConfig,
)
from kvboost_hf.core.errors import ConfigError, InputError
from kvboost_hf.core.keys import digests_held, model_digest
from kvboost_hf.core.values import is_integer
from kvboost_hf.engine_core import EngineCore
from kvboost_hf.factories import Factories
from kvboost_hf.hf.attention import ATTN_IMPLEMENTATION
from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.hf.chat_segments import DocumentBoundaries
from kvboost_hf.hf.decode import DecodeRequest, DecodeRow
from kvboost_hf.hf.graphs import GraphConfig, GraphedDecoder, GraphWarmUp, parse_graph_shapes
from kvboost_hf.hf.models import (
    CACHE_ARGUMENT,
    check_model_support,
    is_loaded_model,
    load_model_and_tokenizer,
    load_streamed_model,
)
from kvboost_hf.hf.prompts import Prompt, PromptEncoder
from kvboost_hf.hf.sampling import SamplingConfig
from kvboost_hf.hf.speculative import DraftConfig, DraftSource
from kvboost_hf.hf.tokens import SegmentTokenizer, TokenCacheConfig, TokenIdsCache
from kvboost_hf.hf.warm import PromptWarmer
from kvboost_hf.offload import LayerStreamingConfig, layer_streamer
from kvboost_hf.results import CorrectnessReport, GenerationResult, PromptCheck, WarmResult
from kvboost_hf.scheduling import RequestGroup
from kvboost_hf.store.chunk_store import ChunkStore, StoreConfig

logger = logging.getLogger(__name__)


def sampling_params(
    sampling: SamplingConfig | None,
    *,
    temperature: float | None = None,
    do_sample: bool | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> SamplingConfig:
    """``sampling``, or the :class:`SamplingConfig` the shorthands describe (one path, never both).

    Shorthands: greedy unless ``do_sample`` (then ``temperature``, default 1.0, and ``top_p``, default 1.0);
    ``seed`` seeds the row's generator. Raises ValueError when ``sampling`` is given together with a shorthand.
    """
    shorthands = {"temperature": temperature, "do_sample": do_sample, "top_p": top_p, "seed": seed}
    given = [name for name, value in shorthands.items() if value is not None]
    if isinstance(sampling, SamplingConfig):
        if given:
            raise ConfigError(f"give sampling= or the shorthands {given}, not both: put them in the SamplingConfig")
        return sampling
    if sampling is not None and not isinstance(sampling, SamplingConfig):
        raise ConfigError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    temperature = 1.0 if temperature is None else temperature
    top_p = 1.0 if top_p is None else top_p
    return SamplingConfig(temperature=temperature if do_sample else 0.0, top_p=top_p, seed=seed)


def check_settings_type(name: str, value: object, cls: type) -> None:
    """Raise ConfigError unless ``value`` (the ``name`` argument) is None or a ``cls`` (``graphs=True`` was taken,
    then failed inside ``generate``)."""
    if value is not None and not isinstance(value, cls):
        raise ConfigError(f"{name} must be a {cls.__name__} or None, got {type(value).__name__}")


def _check_callback(on_token: object) -> None:
    """Raise ConfigError unless ``on_token`` is None or callable (it failed at the first token, after a prefill)."""
    if on_token is not None and not callable(on_token):
        raise ConfigError(f"on_token must be a function of the new token (or None), got {on_token!r}")


def load_model(
    model_name_or_path: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    strict: bool = True,
    streaming: LayerStreamingConfig | None = None,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer :meth:`InferenceEngine.from_pretrained` wraps (same arguments), layer-streamed when
    ``streaming`` is given, with ``attn_implementation`` (None: the package's default for the device it runs on,
    :func:`~kvboost_hf.hf.attention.default_attn_implementation`)."""
    check_settings_type("streaming", streaming, LayerStreamingConfig)
    if streaming is None:
        return load_model_and_tokenizer(
            model_name_or_path, device=device, dtype=dtype, strict=strict, attn_implementation=attn_implementation
        )
    model, tokenizer, _ = load_streamed_model(
        model_name_or_path,
        streaming,
        device=device,
        dtype=dtype,
        strict=strict,
        attn_implementation=attn_implementation,
    )
    return model, tokenizer


def graphs_by_default(device: torch.device) -> bool:
    """Whether an engine graphs its forwards on ``device`` unless its :class:`~kvboost_hf.hf.graphs.GraphConfig`
    says otherwise (the engine's default, the server's without ``--graphs``/``--no-graphs``): on CUDA only
    (elsewhere a graph saves no launches)."""
    return device.type == "cuda"


#: Tokens a generate call adds to each prompt unless told otherwise (``GenerateOptions.max_new_tokens``, the engine's
#: generate entry points): the one place it is written.
DEFAULT_MAX_NEW_TOKENS = 64


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """What one ``generate``, ``generate_batch`` or ``generate_many`` call asks of every prompt (their shared
    keyword arguments, gathered once).

    Args:
        max_new_tokens: the token budget of each row (>= 1; prompt plus budget within the model's context).
        mode: the reuse mode (``"baseline"``, ``"prefix_cache"``, ``"chunk_kv_reuse"``).
        temperature, do_sample, top_p, seed: shorthands of ``sampling`` (see :func:`sampling_params`; giving both
            raises :class:`~kvboost_hf.core.errors.ConfigError` here, before any prompt is tokenized).
        stop: a string or strings that end a row (its text cut exactly before the first).
        cache_salt: the tenant whose namespace the caches read and write.
        cancel: when set, every row ends after its current token (finish reason ``"cancelled"``).
        logprobs: None = no log-probabilities; k >= 0 = each token's and the top ``k`` (and the first token's
            logits).
        repair: overrides the engine's repair settings for this call.
        sampling: every decoding option the server has (top-k, min-p, penalties, logit bias, seed, ...).

    ``decoding`` is the :class:`SamplingConfig` every row decodes with (``sampling``, or the shorthands').
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE
    temperature: float | None = None
    do_sample: bool | None = None
    top_p: float | None = None
    stop: str | Sequence[str] | None = None
    seed: int | None = None
    cache_salt: str | None = None
    cancel: threading.Event | None = None
    logprobs: int | None = None
    repair: RepairConfig | None = None
    sampling: SamplingConfig | None = None
    decoding: SamplingConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Refuse an option of the wrong type or range (:class:`~kvboost_hf.core.errors.ConfigError` naming it)."""
        stops = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stops is not None and not (
            isinstance(stops, (list, tuple)) and all(isinstance(stop, str) and stop for stop in stops)
        ):
            raise ConfigError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.logprobs is not None and not (is_integer(self.logprobs) and self.logprobs >= 0):
            raise ConfigError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if not _is_mode(self.mode):
            names = ", ".join(repr(mode.value) for mode in GenerationMode)
            raise ConfigError(f"mode must be one of {names}, got {self.mode!r}")
        if self.cancel is not None and not callable(getattr(self.cancel, "is_set", None)):
            raise ConfigError(f"cancel must be a threading.Event (or None), got {type(self.cancel).__name__}")
        if self.repair is not None and not isinstance(self.repair, RepairConfig):
            raise ConfigError(f"repair must be a RepairConfig, got {type(self.repair).__name__}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ConfigError(f"cache_salt must be a string (the tenant) or None, got {self.cache_salt!r}")
        decoding = sampling_params(
            self.sampling, temperature=self.temperature, do_sample=self.do_sample, top_p=self.top_p, seed=self.seed
        )
        object.__setattr__(self, "decoding", decoding)

    def requests(self, encoded: Sequence[tuple[list[int], list[int]]]) -> list[DecodeRequest]:
        """One decode request per encoded prompt (its token ids and segment starts) with these options."""
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return [
            DecodeRequest(
                prompt_ids=ids,
                max_new_tokens=self.max_new_tokens,
                sampling=self.decoding,
                stop=stops,
                top_logprobs=self.logprobs,
                cancel=self.cancel,
                keep_first_logits=self.logprobs is not None,
                segment_starts=tuple(starts),
            )
            for ids, starts in encoded
        ]


def _prompt_list(prompts: object) -> Sequence[Prompt]:
    """``prompts`` when it is a list of prompts; InputError otherwise (a string is one prompt, not a list of them)."""
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise InputError(f"prompts must be a list of prompts, got {type(prompts).__name__} (one: use generate)")
    return prompts


def _is_mode(value: object) -> bool:
    """Whether ``value`` names a :class:`GenerationMode` (a member, its value or an accepted alias)."""
    try:
        GenerationMode(value)
    except (ValueError, TypeError):
        return False
    return True


class InferenceEngine:
    """Chunk K/V reuse around a Hugging Face causal LM.

    Args:
        model, tokenizer: a loaded causal LM and its tokenizer.
        chunking: how prompts are cut (:class:`ChunkingConfig`, None for its defaults; an int is a fixed chunk size;
            :meth:`ChunkingConfig.from_tokenizer` builds one whose cuts may slide back to sentence ends).
        repair: repair of non-prefix hits (default ``RepairConfig()``; see :class:`RepairConfig` and
            :mod:`kvboost_hf.reuse.repair`).
        store: the chunk store: a :class:`StoreConfig` to build one from (default ``StoreConfig()``: 2 GiB of
            RAM, no lower tier; with the model on CUDA, RAM entries pinned and a GPU tier in front of RAM sized
            from the free GPU memory, see :meth:`StoreConfig.for_model_device`), or an existing
            :class:`ChunkStore` to share (with another engine, a draft...).
        strict: refuse architectures that are not known to work.
        draft_model: a resident draft for speculative decoding (a path or hub name, loaded on the target's device
            and dtype; a model; or another engine, whose store and chunk settings its cache then uses); it must
            share the target's tokenizer. Its prompt K/V are reused from the store like the target's (under its
            own namespace). Every call (batched too) decodes with it; it never changes the tokens (see
            :mod:`kvboost_hf.hf.speculative`), only the number of target forwards.
        draft: how the draft proposes (:class:`DraftConfig`: tokens per round, tree budget and branching; with
            ``early_exit_layers`` the target's own first layers draft and no ``draft_model`` is needed).
        graphs: CUDA graphs for plain decode steps, speculative verify forwards and the prompt forwards of short
            uncached tails after reused K/V, e.g. a warm chat turn (:class:`~kvboost_hf.hf.graphs.GraphConfig`;
            default on when the model is on CUDA, off elsewhere; ``GraphConfig(enabled=False)`` turns them off):
            one :class:`~kvboost_hf.hf.graphs.GraphedDecoder` shared by every call, its counters in
            :meth:`cache_stats` (``graph_*``).
        token_cache: the prompt token ids cache (:class:`~kvboost_hf.hf.tokens.TokenCacheConfig`, default 64 MiB):
            each prompt is tokenized once, and only its pieces between special tokens not seen before
            (:attr:`tokens`, a :class:`~kvboost_hf.hf.tokens.SegmentTokenizer`; ids identical to the tokenizer's).

    The engine is a facade over three parts: :attr:`prompts` (a :class:`~kvboost_hf.hf.prompts.PromptEncoder`:
    rendering, tokenizing, segments, the context length, end and padding tokens), :attr:`warmer` (a
    :class:`~kvboost_hf.hf.warm.PromptWarmer`) and :attr:`factories` (a :class:`~kvboost_hf.factories.Factories`:
    caches, batch policy and key space, decode loops and their drafters, schedulers, rows, decode totals). Its
    attributes ``model``, ``tokenizer``, ``chunking``, ``repair``, ``tokens``, ``max_context``, ``graphs``, ``lock``,
    ``draft_model``, ``speculative`` and ``verify_costs`` are those of its parts (read them, do not assign them);
    :attr:`store` and :attr:`draft_settings` may be assigned (later calls use the new ones).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        chunking: ChunkingConfig | int | None = None,
        repair: RepairConfig | None = None,
        store: ChunkStore | StoreConfig | None = None,
        strict: bool = True,
        draft_model: DraftSource | None = None,
        draft: DraftConfig | None = None,
        token_cache: TokenCacheConfig | None = None,
        graphs: GraphConfig | None = None,
    ) -> None:
        if not is_loaded_model(model):
            raise ConfigError(
                f"KVBoost(model, tokenizer): model must be a loaded transformers model, got {model!r} (load one "
                "by name with KVBoost.from_pretrained)"
            )
        check_model_support(model.config, strict=strict)
        if not callable(getattr(tokenizer, "encode", None)):
            raise ConfigError(
                f"KVBoost(model, tokenizer): tokenizer must be a transformers tokenizer, got {tokenizer!r}"
            )
        if store is not None and not isinstance(store, ChunkStore | StoreConfig):
            raise ConfigError(f"store must be a ChunkStore, a StoreConfig or None, got {type(store).__name__}")
        for name, value, cls in (
            ("repair", repair, RepairConfig),
            ("draft", draft, DraftConfig),
            ("token_cache", token_cache, TokenCacheConfig),
            ("graphs", graphs, GraphConfig),
        ):
            check_settings_type(name, value, cls)
        self.chunking = ChunkingConfig.of(chunking)
        self.repair = repair if repair is not None else RepairConfig()
        if self.repair.adjusts_attention and model.config._attn_implementation != ATTN_IMPLEMENTATION:
            logger.info("attn_implementation=%r for the repair's context temperature/scale", ATTN_IMPLEMENTATION)
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.tokenizer = tokenizer
        self.tokens = SegmentTokenizer(tokenizer, TokenIdsCache((token_cache or TokenCacheConfig()).max_bytes))
        self.prompts = PromptEncoder(model, tokenizer, self.tokens)
        self.max_context = self.prompts.max_context
        if not isinstance(store, ChunkStore):  # on CUDA, a GPU tier sized from the memory the model left free
            store = ChunkStore((store or StoreConfig()).for_model_device(self.device))
        self.graphs = GraphedDecoder(model, graphs or GraphConfig(enabled=graphs_by_default(self.device)))
        self.lock = threading.RLock()  # held while the model runs: one forward at a time
        model_digest(model)  # computed once here, not inside the first request's TTFT
        self.factories = Factories(
            model, tokenizer, self.prompts, store, self.chunking, self.repair, self.graphs,
            draft_model=draft_model, draft=draft, strict=strict,
        )  # fmt: skip
        self.draft_model = self.factories.draft_model
        self.speculative = self.factories.speculative
        self.verify_costs = self.factories.verify_costs  # the target's timed verify forwards (adaptive tree budget)
        self.warmer = PromptWarmer(
            model, self.chunking, self.prompts,
            lambda mode, cache_salt, starts: self.new_cache(mode, cache_salt, segment_starts=starts, adapter=False),
            self.lock,
        )  # fmt: skip

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str | os.PathLike | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        strict: bool = True,
        streaming: LayerStreamingConfig | None = None,
        **options: Any,
    ) -> InferenceEngine:
        """Load a model by hub name or local directory (``None``: the embedded SmolLM2-135M-Instruct) and wrap it.

        ``device`` defaults to CUDA when available; ``dtype`` to float32 on CPU and bfloat16 on GPU. ``streaming``:
        load the weights into host memory and stream the decoder layers it chooses to ``streaming.device``
        (default ``device``; see :mod:`kvboost_hf.offload`). ``options`` are the constructor's keyword arguments
        (``chunking``, ``repair``, ``store``, ``draft_model``, ``draft``, ``token_cache``, ``graphs``).
        """
        model, tokenizer = load_model(
            model_name_or_path, device=device, dtype=dtype, strict=strict, streaming=streaming
        )
        return cls(model, tokenizer, strict=strict, **options)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def store(self) -> ChunkStore:
        """The chunk store every cache of this engine reads and writes (assigning another applies to later calls)."""
        return self.factories.store

    @store.setter
    def store(self, store: ChunkStore) -> None:
        self.factories.store = store

    @property
    def draft_settings(self) -> DraftConfig:
        """How the draft proposes (the factories' settings; assigning new ones applies to the next call's loops)."""
        return self.factories.draft_settings

    @draft_settings.setter
    def draft_settings(self, settings: DraftConfig) -> None:
        self.factories.draft_settings = settings

    # ------------------------------------------------------------------ prompts (see PromptEncoder)
    def render(self, prompt: Prompt, *, add_generation_prompt: bool = True) -> str:
        """The text the model sees (:meth:`PromptEncoder.render <kvboost_hf.hf.prompts.PromptEncoder.render>`)."""
        return self.prompts.render(prompt, add_generation_prompt=add_generation_prompt)

    def encode_segments(
        self,
        prompt: Prompt,
        *,
        add_generation_prompt: bool = True,
        document_boundaries: DocumentBoundaries | str = DocumentBoundaries.PARTS,
    ) -> tuple[list[int], list[int]]:
        """Token ids of the prompt and the token offsets where its segments start
        (:meth:`PromptEncoder.encode_segments <kvboost_hf.hf.prompts.PromptEncoder.encode_segments>`)."""
        return self.prompts.encode_segments(
            prompt, add_generation_prompt=add_generation_prompt, document_boundaries=document_boundaries
        )

    def encode(self, prompt: Prompt, *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered prompt; raises on an empty prompt."""
        return self.prompts.encode(prompt, add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------------ warm (see PromptWarmer)
    def warm(self, text: Prompt, *, cache_salt: str | None = None) -> WarmResult:
        """Compute and store the K/V of ``text`` so that later prompts containing it hit
        (:meth:`PromptWarmer.warm <kvboost_hf.hf.warm.PromptWarmer.warm>`: a string or segments by prefix and
        content key, chat messages by prefix key and their marked content parts by content key)."""
        return self.warmer.warm(text, cache_salt=cache_salt)

    def warm_documents(self, documents: Sequence[str], *, cache_salt: str | None = None) -> list[WarmResult]:
        """Store each document alone, as it appears inside a chat prompt, so that a chat prompt marking it as a
        document hits it at any position (:meth:`PromptWarmer.warm_documents
        <kvboost_hf.hf.warm.PromptWarmer.warm_documents>`)."""
        return self.warmer.warm_documents(documents, cache_salt=cache_salt)

    # ------------------------------------------------------------------ decode graphs
    def warm_up_graphs(self, shapes: Iterable[tuple[int, ...]], *, progress: bool = True) -> GraphWarmUp:
        """Compile and capture the graphs of ``shapes`` now (``(rows, tokens)``: decode steps of a batch of that
        many rows whose cache needs that many tokens, prompt plus answer; ``(rows, tokens, queries)``: prompt
        forwards of ``queries`` new tokens after reused K/V, a warm chat turn's; a
        :class:`~kvboost_hf.hf.graphs.VerifyShape` ``(rows, tokens, drafts)``: speculative verify forwards of
        ``drafts`` draft tokens per row (tree nodes below the root), skipped without a draft; each rounded up to its
        graph buckets), so the requests that later run those shapes pay no compile (~30 s each for a 7B model on a
        GPU) (:meth:`GraphedDecoder.warm_up <kvboost_hf.hf.graphs.GraphedDecoder.warm_up>`: dummy caches built as
        the requests' are, nothing stored, no cache a request sees touched; ``max_graphs`` and ``max_capture_bytes``
        respected). Runs under :attr:`lock`; a tqdm bar with ``progress``; its outcome is also in
        :meth:`cache_stats` (``graph_warmed_shapes``, ``graph_warmed_verify_shapes``, ``graph_warm_up_seconds``)
        and :attr:`graphs`' ``state``. A no-op (every shape skipped) with graphs off, as on a CPU by default."""
        verifier = self.factories.verify_graphs if self.speculative else None
        with self.lock:
            return self.graphs.warm_up(
                lambda: self.new_cache(adapter=False), shapes, progress=progress, verifier=verifier
            )

    def graph_shapes(self, text: str) -> tuple[tuple[int, ...], ...]:
        """The graph shapes a text such as ``"1x4096,8x4096,1x4096x64,2x4096v8"`` names (rows x tokens of a decode
        step, then x queries for a prefill or v draft tokens for a speculative verify forward: ``(rows, capacity)``,
        ``(rows, capacity, query bucket)`` or ``VerifyShape(rows, capacity, draft bucket)``, rounded up to this
        engine's graph buckets; :func:`~kvboost_hf.hf.graphs.parse_graph_shapes`), for
        :meth:`warm_up_graphs`. Raises :class:`~kvboost_hf.core.errors.ConfigError` for a malformed entry or one
        that would run eagerly."""
        return parse_graph_shapes(text, self.graphs.config)

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
        temperature: float | None = None,
        do_sample: bool | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        *,
        seed: int | None = None,
        cache_salt: str | None = None,
        on_token: Callable[[int], None] | None = None,
        cancel: threading.Event | None = None,
        logprobs: int | None = None,
        repair: RepairConfig | None = None,
        sampling: SamplingConfig | None = None,
    ) -> GenerationResult:
        """Generate a completion of ``prompt`` (string or chat messages). ``temperature=0`` means greedy.

        ``on_token`` receives each generated token id as soon as it exists. The other options are
        :class:`GenerateOptions`' (``sampling`` or its shorthands, ``stop``, ``logprobs``, ``cancel``, ``repair``,
        ...). The same seed and settings give the same tokens here and from the server.
        """
        options = GenerateOptions(
            max_new_tokens=max_new_tokens, mode=mode, temperature=temperature, do_sample=do_sample, top_p=top_p,
            stop=stop, seed=seed, cache_salt=cache_salt, cancel=cancel, logprobs=logprobs, repair=repair,
            sampling=sampling,
        )  # fmt: skip
        _check_callback(on_token)
        report = None if on_token is None else (lambda row, token: on_token(token))
        return self._generate([prompt], options, report)[0]

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
        temperature: float | None = None,
        do_sample: bool | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        *,
        seed: int | None = None,
        cache_salt: str | None = None,
        on_token: Callable[[int, int], None] | None = None,
        cancel: threading.Event | None = None,
        logprobs: int | None = None,
        repair: RepairConfig | None = None,
        sampling: SamplingConfig | None = None,
    ) -> list[GenerationResult]:
        """Generate for several prompts (any prefixes, segment prompts included) in one left-padded batch, through
        the scheduler the server runs (:meth:`core`: prompts that the batch policy prefills alone join the
        batch before its first decode step). Each row's greedy output equals what it gets alone, and every row is
        sampled with ``seed`` as if alone. ``on_token(row, token)`` is called as each token exists; the other
        options are :class:`GenerateOptions`'. With a draft every row is decoded speculatively; its tokens are
        those it gets without one. A row's TTFT is measured from the call (tokenizing included)."""
        if not _prompt_list(prompts):
            raise InputError("prompts is empty")
        options = GenerateOptions(
            max_new_tokens=max_new_tokens, mode=mode, temperature=temperature, do_sample=do_sample, top_p=top_p,
            stop=stop, seed=seed, cache_salt=cache_salt, cancel=cancel, logprobs=logprobs, repair=repair,
            sampling=sampling,
        )  # fmt: skip
        return self._generate(prompts, options, on_token)

    def generate_many(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        kv_budget_bytes: int | None = None,
        mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
        cache_salt: str | None = None,
        temperature: float | None = None,
        do_sample: bool | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        on_token: Callable[[int, int], None] | None = None,
        cancel: threading.Event | None = None,
        logprobs: int | None = None,
        repair: RepairConfig | None = None,
        sampling: SamplingConfig | None = None,
    ) -> list[GenerationResult]:
        """Generate for many prompts through the scheduler the server runs (:meth:`core`), up to
        ``max_batch_size`` rows at a time: prompts are admitted shortest first, a new one joins the running batch
        as soon as a row leaves it (continuous batching), a segment prompt or one whose reuse needs a repair is
        prefilled alone and then decodes with the batch, and chunks stored by earlier rows are loaded by later
        ones; each step computes at most ``token_budget`` tokens (0: none), so a long prompt joining is prefilled
        in chunks between the running rows' steps; the running rows' K/V stay within ``kv_budget_bytes`` (None:
        derived from the free device memory on CUDA, none elsewhere; 0: none): a prompt waits while its K/V would
        not fit, and the newest rows are preempted (their chunks stored, resumed later from the store with the
        same tokens) when the batch outgrows it. Options are :meth:`generate_batch`'s; input order is kept. A
        row's TTFT is measured from the call for the rows admitted first, from its first admission for a row
        admitted later."""
        options = GenerateOptions(
            max_new_tokens=max_new_tokens, mode=mode, temperature=temperature, do_sample=do_sample, top_p=top_p,
            stop=stop, seed=seed, cache_salt=cache_salt, cancel=cancel, logprobs=logprobs, repair=repair,
            sampling=sampling,
        )  # fmt: skip
        return self._generate(
            prompts, options, on_token, max_batch_size=max_batch_size, token_budget=token_budget,
            kv_budget_bytes=kv_budget_bytes,
        )  # fmt: skip

    def _generate(
        self,
        prompts: Sequence[Prompt],
        options: GenerateOptions,
        on_token: Callable[[int, int], None] | None,
        max_batch_size: int | None = None,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        kv_budget_bytes: int | None = None,
    ) -> list[GenerationResult]:
        """The one generate path: one row per prompt (tokenized once, with its segment starts), queued on a fresh
        :meth:`core` (``max_batch_size`` None: every row in one batch, in input order, no token budget and no
        K/V budget: all rows start together, nothing runs that a prefill could pause; else at most that many rows
        at a time, shortest prompt first, ``token_budget`` tokens per step, K/V within ``kv_budget_bytes``),
        stepped until every row finished; the results in input order (the first error a batch met is raised).
        ``on_token(index, token)`` after each token of input ``index``. A row's TTFT runs from the call (tokenizing
        included) when it was admitted in the first step, else from its first admission."""
        started = time.perf_counter()
        _prompt_list(prompts)
        _check_callback(on_token)
        self.prompts.check_token_ids([token for token, _ in options.decoding.logit_bias], "logit_bias token ids")
        self.prompts.check_token_ids(options.decoding.stop_token_ids, "stop_token_ids")
        encoded = [self.prompts.encode_segments(prompt) for prompt in prompts]
        for ids, _ in encoded:
            self.prompts.check_length(len(ids), options.max_new_tokens)
        rows = self.factories.new_rows(options.requests(encoded))
        order: Sequence[int] = range(len(rows))
        if max_batch_size is not None:
            order = sorted(order, key=lambda index: len(rows[index].request.prompt_ids))
        budget = 0 if max_batch_size is None else token_budget
        kv_budget = 0 if max_batch_size is None else kv_budget_bytes
        if max_batch_size is None:
            max_batch_size = len(rows)
        errors: list[BaseException] = []
        groups = [
            RequestGroup(
                [rows[index]],
                options.cache_salt,
                on_token=(lambda row: None) if on_token is None else functools.partial(_report_token, on_token, index),
                on_fail=errors.append,
            )
            for index in range(len(rows))
        ]
        with digests_held():  # the cache, batch policy and draft of this request check the weights once
            core = self.core(
                options.mode, max_batch_size=max_batch_size, token_budget=budget, kv_budget_bytes=kv_budget,
                repair=options.repair,
            )  # fmt: skip
            for index in order:
                core.scheduler.add(groups[index])
            with self.lock:
                core.run()
        if errors:
            raise errors[0]
        mode = GenerationMode(options.mode)
        first_admission = min((group.admitted_at or started for group in groups), default=started)
        starts = [started if group.admitted_at == first_admission else group.admitted_at or started for group in groups]
        return [
            _result(group, mode, start, prompt if isinstance(prompt, str) else self.tokenizer.decode(ids))
            for group, start, prompt, (ids, _) in zip(groups, starts, prompts, encoded, strict=True)
        ]

    # ------------------------------------------------------------------ factories (see Factories)
    def core(
        self,
        mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        kv_budget_bytes: int | None = None,
        batch_window_ms: float = 0.0,
        repair: RepairConfig | None = None,
        tokenizer_lock: contextlib.AbstractContextManager | None = None,
        pack_forwards: bool = DEFAULT_PACK_FORWARDS,
    ) -> EngineCore:
        """An :class:`~kvboost_hf.engine_core.EngineCore` for this engine (:meth:`Factories.core
        <kvboost_hf.factories.Factories.core>`): a scheduler and a model runner of its decode loops in ``mode``, at
        most ``max_batch_size`` rows running and ``token_budget`` tokens computed per step (0: no budget), their K/V
        within ``kv_budget_bytes`` (None: derived from the free device memory on CUDA, none elsewhere; 0: none), a
        new batch formed once its oldest request waited ``batch_window_ms``; each batch's decode figures and the
        memory counters are added to :meth:`cache_stats`. The rows' text is decoded (special tokens skipped) under
        ``tokenizer_lock``. ``pack_forwards``: the batches' decode steps and prompt chunks share one forward where
        they can (False: a forward each). Step it under :attr:`lock`."""
        return self.factories.core(
            mode,
            max_batch_size=max_batch_size,
            token_budget=token_budget,
            kv_budget_bytes=kv_budget_bytes,
            batch_window_ms=batch_window_ms,
            repair=repair,
            tokenizer_lock=tokenizer_lock,
            pack_forwards=pack_forwards,
        )

    def new_cache(
        self,
        mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
        cache_salt: str | None = None,
        segment_starts: Sequence[int] = (),
        repair: RepairConfig | None = None,
        model: PreTrainedModel | None = None,
        *,
        adapter: bool = True,
    ) -> ChunkReuseCache:
        """A fresh drop-in cache bound to this engine's store and settings (for ``model``, default this engine's).
        ``adapter=False`` for forwards driven explicitly (the engine's own): no hooks are installed on the model."""
        return self.factories.new_cache(mode, cache_salt, segment_starts, repair, model, adapter=adapter)

    # ------------------------------------------------------------------ checks and stats
    def cache_stats(self, *, settle: bool = True) -> dict[str, int | float]:
        """Store counters (hits, misses, chunks, evictions, bytes per tier: ``ram_bytes``, ...); decode counters
        summed over this engine's calls (:meth:`DecodeTotals.stats <kvboost_hf.factories.DecodeTotals.stats>`:
        :data:`~kvboost_hf.factories.DECODE_TOTALS`, with ``tokens_per_target_forward``,
        ``draft_tokens_accepted_per_verify`` and ``draft_acceptance_rate``, 0.0 before any draft proposal); with
        layer streaming also ``streamed_bytes_per_token`` (bytes streamed by decode calls / generated tokens) and the
        streamer's counters prefixed ``streaming_`` (see :class:`~kvboost_hf.offload.StreamingStats`, all copies
        included; ``settle=False`` reads its host-side counters only, never synchronising the device, as a thread
        other than the model's must); the prompt token ids cache's counters (``token_cache_*``:
        :meth:`~kvboost_hf.hf.tokens.SegmentTokenizer.stats`); the decode graphs' counters (``graph_*``:
        :meth:`~kvboost_hf.hf.graphs.GraphedDecoder.stats`, and the speculative verify graphs':
        :meth:`~kvboost_hf.hf.verify_graphs.GraphedVerifier.stats`); the schedulers' K/V memory counters (``kv_*``:
        :class:`~kvboost_hf.scheduling.MemoryCounters`: preemptions, rows preempted, admissions deferred, bytes
        reserved now and at most)."""
        totals = self.factories.totals.totals
        stats: dict[str, int | float] = {
            **self.store.stats(),
            **self.factories.totals.stats(),
            **self.tokens.stats(),
            **{f"graph_{name}": value for name, value in self.graphs.stats().items()},
            **{f"graph_{name}": value for name, value in self.factories.verify_graphs.stats().items()},
            **{f"kv_{name}": value for name, value in dataclasses.asdict(self.factories.memory).items()},
        }
        streamer = layer_streamer(self.model)
        if streamer is not None:
            stats["streamed_bytes_per_token"] = totals["streamed_bytes"] / max(totals["generated_tokens"], 1)
            stats.update({f"streaming_{k}": v for k, v in streamer.stats(settle=settle).as_dict().items()})
        return stats

    def verify_correctness(
        self, prompts: Sequence[Prompt] | None = None, max_new_tokens: int = 32
    ) -> CorrectnessReport:
        """Greedy output with reuse (after a first call stored the prompt's chunks) against transformers' own
        ``model.generate()`` (greedy, a ``DynamicCache`` from the model's config, the same rendered prompt, EOS and
        pad ids), not against this engine's decode loop: tokens identical, first differing step, and the largest
        difference of the first token's raw logits."""
        if prompts is None:
            from kvboost_hf.corpus import sample_prompts

            prompts = sample_prompts()
        report = CorrectnessReport()
        for prompt in prompts:
            ids = torch.tensor([self.encode(prompt)], device=self.device)
            plain = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **{CACHE_ARGUMENT: DynamicCache(config=self.model.config)},
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=sorted(self.prompts.eos_token_ids) or None,
                pad_token_id=self.prompts.pad_token_id,
                return_dict_in_generate=True,
                output_logits=True,
            )
            expected = plain.sequences[0, ids.shape[1] :].tolist()
            self.generate(prompt, max_new_tokens)  # stores the prompt's chunks
            reused = self.generate(prompt, max_new_tokens, logprobs=0)
            pairs = zip(expected, reused.output_ids, strict=False)
            first_diff = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
            if first_diff is None and len(expected) != len(reused.output_ids):
                first_diff = min(len(expected), len(reused.output_ids))
            diff = float((plain.logits[0][0].float().cpu() - reused.first_token_logits).abs().max())
            report.checks.append(
                PromptCheck(self.render(prompt), first_diff is None, first_diff, diff, reused.cached_tokens)
            )
        return report


def _result(group: RequestGroup, mode: GenerationMode, started: float, prompt: str) -> GenerationResult:
    """The :class:`GenerationResult` of a finished one-row group: times from ``started`` (a ``time.perf_counter()``
    value), its batch's decode figures, ``prompt`` its prompt's text (a text prompt as given: decoding a 32k-token
    prompt again cost ~15 ms per call; chat messages and token ids decoded)."""
    (row,) = group.rows
    batch = group.batch
    assert batch is not None and batch.decode_counts is not None, "the group ran in a batch that ended"
    streamed = batch.decode_counts.get("streamed_bytes")
    first = row.first_token_time or started
    finished = row.last_token_time or first
    prompt_tokens = len(row.request.prompt_ids)
    tokens = row.tokens
    later = len(tokens) - 1
    logprobs = row.logprobs if row.request.top_logprobs is not None else None
    return GenerationResult(
        mode=mode.value,
        prompt=prompt,
        output_text=row.text,
        output_ids=list(tokens),
        generated_tokens=len(tokens),
        ttft_ms=(first - started) * 1e3,
        total_ms=(finished - started) * 1e3,
        tokens_per_sec=later / max(finished - first, 1e-9) if later > 0 else 0.0,
        kv_reuse_ratio=row.reuse.cached_tokens / prompt_tokens,
        prompt_tokens=prompt_tokens,
        cached_tokens=row.reuse.cached_tokens,
        approx_tokens=row.reuse.approx_tokens,
        recomputed_tokens=row.reuse.recomputed_tokens,
        first_token_logits=row.first_logits,
        finish_reason=row.finish_reason or "length",
        token_logprobs=None if logprobs is None else [entry.logprob for entry in logprobs],
        top_logprobs=None if logprobs is None else [list(entry.top) for entry in logprobs],
        **batch.decode_counts,
        streamed_bytes_per_token=None if streamed is None else streamed / max(len(tokens), 1),
    )


def _report_token(on_token: Callable[[int, int], None], index: int, row: DecodeRow) -> None:
    """``on_token(index, newest token)`` for a row of input ``index`` (called after each of its tokens)."""
    if row.tokens:
        on_token(index, row.tokens[-1])
