"""The engine facade: one object that owns a model, its tokenizer and a chunk store.

``KVBoost`` (this module's :class:`InferenceEngine`) renders prompts, runs the decode loop
(:class:`~kvboost_hf.hf.decode.DecodeLoop`, speculative when the engine has a draft) with a fresh
:class:`~kvboost_hf.hf.cache.ChunkReuseCache` per call, and reports time to first token and reuse.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeGuard

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvboost_hf.core.chunking import ChunkingConfig, chunk_spans
from kvboost_hf.core.config import GenerationMode, RepairConfig
from kvboost_hf.core.errors import CapacityError, ConfigError, InputError
from kvboost_hf.core.keys import KeySpace, model_digest
from kvboost_hf.hf.attention import ATTN_IMPLEMENTATION
from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.hf.chat_segments import DocumentBoundaries, encode_chat_segments, joined
from kvboost_hf.hf.decode import DecodeLoop, DecodeRequest, DecodeRow, left_pad
from kvboost_hf.hf.graphs import GraphConfig, GraphedDecoder
from kvboost_hf.hf.models import (
    CACHE_ARGUMENT,
    check_model_support,
    load_model_and_tokenizer,
    load_streamed_model,
    model_dtype,
)
from kvboost_hf.hf.prefill import forward
from kvboost_hf.hf.sampling import SamplingConfig
from kvboost_hf.hf.speculative import DraftConfig, Drafter, DraftSource, VerifyCosts, resolve_draft
from kvboost_hf.hf.tokens import SegmentTokenizer, TokenCacheConfig, TokenIdsCache
from kvboost_hf.offload import LayerStreamingConfig, layer_streamer
from kvboost_hf.results import CorrectnessReport, GenerationResult, PromptCheck, WarmResult
from kvboost_hf.scheduling import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_TOKEN_BUDGET,
    BatchKey,
    BatchPolicy,
    RequestGroup,
    Scheduler,
)
from kvboost_hf.store.chunk_store import ChunkStore, StoreConfig

logger = logging.getLogger(__name__)

Prompt = str | Sequence[str] | Sequence[dict[str, Any]] | Sequence[int]
"""A string; a list of strings (segments: documents, a question, each starting a chunk, concatenated as is);
chat messages (``{"role": ..., "content": ...}``) rendered with the tokenizer's chat template, where a content
given as a list of strings is a list of text parts (joined; each part of a two-or-more-part content starts a
segment, see :mod:`kvboost_hf.hf.chat_segments`); or token ids."""

# Decode counters summed over an engine's calls (:meth:`InferenceEngine.cache_stats`): tokens of all rows; target
# forwards (a batch's rows share them) and those that verified draft tokens; draft tokens (tree nodes) the target
# verified and those it kept; bytes the target's layer streamer copied during decode calls (0 when not streamed).
DECODE_TOTALS = (
    "generated_tokens",
    "target_forwards",
    "verify_forwards",
    "draft_tokens_proposed",
    "draft_tokens_accepted",
    "streamed_bytes",
)


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
    if sampling is not None:
        if given:
            raise ConfigError(f"give sampling= or the shorthands {given}, not both: put them in the SamplingConfig")
        return sampling
    temperature = 1.0 if temperature is None else float(temperature)
    top_p = 1.0 if top_p is None else float(top_p)
    return SamplingConfig(temperature=temperature if do_sample else 0.0, top_p=top_p, seed=seed)


def load_model(
    model_name_or_path: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    strict: bool = True,
    streaming: LayerStreamingConfig | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer :meth:`InferenceEngine.from_pretrained` wraps (same arguments), layer-streamed when
    ``streaming`` is given."""
    if streaming is None:
        return load_model_and_tokenizer(model_name_or_path, device=device, dtype=dtype, strict=strict)
    model, tokenizer, _ = load_streamed_model(model_name_or_path, streaming, device=device, dtype=dtype, strict=strict)
    return model, tokenizer


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
        graphs: CUDA graphs for plain decode steps (:class:`~kvboost_hf.hf.graphs.GraphConfig`; default on when the
            model is on CUDA, off elsewhere; ``GraphConfig(enabled=False)`` turns them off): one
            :class:`~kvboost_hf.hf.graphs.GraphedDecoder` shared by every call, its counters in :meth:`cache_stats`
            (``graph_*``).
        token_cache: the prompt token ids cache (:class:`~kvboost_hf.hf.tokens.TokenCacheConfig`, default 64 MiB):
            each prompt is tokenized once, and only its pieces between special tokens not seen before
            (:attr:`tokens`, a :class:`~kvboost_hf.hf.tokens.SegmentTokenizer`; ids identical to the tokenizer's).
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
        check_model_support(model.config, strict=strict)
        self.chunking = ChunkingConfig.of(chunking)
        self.repair = repair if repair is not None else RepairConfig()
        if self.repair.adjusts_attention and model.config._attn_implementation != ATTN_IMPLEMENTATION:
            logger.info("attn_implementation=%r for the repair's context temperature/scale", ATTN_IMPLEMENTATION)
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.tokenizer = tokenizer
        self.tokens = SegmentTokenizer(tokenizer, TokenIdsCache((token_cache or TokenCacheConfig()).max_bytes))
        self.max_context = int(getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", 0))
        if not isinstance(store, ChunkStore):  # on CUDA, a GPU tier sized from the memory the model left free
            store = ChunkStore((store or StoreConfig()).for_model_device(self.device))
        self.store = store
        self.graphs = GraphedDecoder(model, graphs or GraphConfig(enabled=self.device.type == "cuda"))
        self.lock = threading.RLock()  # held while the model runs: one forward at a time
        model_digest(model)  # computed once here, not inside the first request's TTFT
        self._init_draft(draft_model, draft, strict)

    def _init_draft(self, draft_model: DraftSource | None, draft: DraftConfig | None, strict: bool) -> None:
        """Speculative decoding state: the draft settings, the resident draft model (if any) and decode counters."""
        self.draft_settings = draft if draft is not None else DraftConfig()
        self.draft_model: PreTrainedModel | None = None
        self._draft_engine: InferenceEngine | None = draft_model if isinstance(draft_model, InferenceEngine) else None
        if draft_model is not None:

            def load(path: str | os.PathLike) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
                return load_model_and_tokenizer(path, device=self.device, dtype=model_dtype(self.model), strict=strict)

            self.draft_model = resolve_draft(draft_model, self.model, self.tokenizer, load)
            check_model_support(self.draft_model.config, strict=strict)
            model_digest(self.draft_model)
        self.draft_settings.check(self.model, self.draft_model)
        self.speculative = draft_model is not None or self.draft_settings.early_exit_layers is not None
        self._decode_totals = dict.fromkeys(DECODE_TOTALS, 0)
        self.verify_costs = VerifyCosts()  # the target's timed verify forwards (adaptive tree budget)

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

    # ------------------------------------------------------------------ prompts
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def render(self, prompt: Prompt, *, add_generation_prompt: bool = True) -> str:
        """The text the model sees: a string as is, segments concatenated, chat messages (content parts joined)
        through the template, token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        items = list(prompt)
        if _token_ids(items):
            return self.tokenizer.decode(items)
        if items and all(isinstance(item, str) for item in items):
            return "".join(str(item) for item in items)
        messages = _chat_messages(items)
        return self.tokenizer.apply_chat_template(
            joined(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_segments(
        self,
        prompt: Prompt,
        *,
        add_generation_prompt: bool = True,
        document_boundaries: DocumentBoundaries | str = DocumentBoundaries.PARTS,
    ) -> tuple[list[int], list[int]]:
        """Token ids of the prompt and the token offsets where its segments start (empty for a single text).

        Every text is tokenized once (through :attr:`tokens`: pieces seen before come from its cache).
        Segments are tokenized one by one (the first with the tokenizer's special tokens) so each starts a chunk.
        Chat messages are tokenized as one rendered text; ``document_boundaries`` says which contents start
        segments (:func:`~kvboost_hf.hf.chat_segments.encode_chat_segments`: the ids never depend on it).
        Token ids are used as given (each must be in the model's vocabulary).
        """
        if not isinstance(prompt, str) and _token_ids(items := list(prompt)):
            token_ids = items
            vocab = self.model.config.get_text_config(decoder=True).vocab_size
            if bad := [token for token in token_ids if not 0 <= token < vocab]:
                raise InputError(f"token ids {bad[:5]} are outside the model's vocabulary of {vocab}")
            return token_ids, []
        if isinstance(prompt, str):
            return self._tokenize(prompt, add_special_tokens=True), []
        segments = list(prompt)
        if not segments or not all(isinstance(item, str) for item in segments):
            chat_ids, chat_starts = encode_chat_segments(
                self.tokenizer,
                _chat_messages(segments),
                boundaries=document_boundaries,
                add_generation_prompt=add_generation_prompt,
                tokens=self.tokens,
            )
            if not chat_ids:
                raise InputError("prompt tokenizes to zero tokens")
            return chat_ids, chat_starts
        ids: list[int] = []
        starts: list[int] = []
        for index, segment in enumerate(segments):
            starts.append(len(ids))
            ids += self._tokenize(str(segment), add_special_tokens=index == 0, allow_empty=True)
        if not ids:
            raise InputError("prompt is empty")
        return ids, starts

    def encode(self, prompt: Prompt, *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered prompt; raises on an empty prompt."""
        return self.encode_segments(prompt, add_generation_prompt=add_generation_prompt)[0]

    def _tokenize(self, text: str, *, add_special_tokens: bool, allow_empty: bool = False) -> list[int]:
        if not text and not allow_empty:
            raise InputError("prompt is empty")
        ids = self.tokens.encode(text, add_special_tokens=add_special_tokens) if text else []
        if not ids and not allow_empty:
            raise InputError("prompt tokenizes to zero tokens")
        return ids

    def _check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if self.max_context and prompt_tokens + max_new_tokens > self.max_context:
            raise CapacityError(
                f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens} exceeds the model's context "
                f"of {self.max_context} tokens"
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
        return ChunkReuseCache(
            self.store,
            model if model is not None else self.model,
            self.chunking,
            repair or self.repair,
            mode=mode,
            cache_salt=cache_salt,
            segment_starts=tuple(segment_starts),
            adapter=adapter,
        )

    # ------------------------------------------------------------------ warm
    def warm(self, text: Prompt, *, cache_salt: str | None = None) -> WarmResult:
        """Compute and store the K/V of ``text`` so that later prompts containing it hit.

        A string is stored as one segment: by prefix key (prompts starting with it hit exactly) and by content
        key, its last partial chunk included (prompts holding it at any offset, given as a segment, hit it and
        repair it). A list of segments is stored the same way, segment by segment (``[header, document]`` stores
        the document as computed after the header). Chat messages are rendered without a generation prompt and
        stored by prefix key, and their marked content parts (see :meth:`encode_segments`) by content key too.
        """
        ids, starts = self.encode_segments(text, add_generation_prompt=False)
        if starts or isinstance(text, str):  # the last segment ends here: its partial last chunk is stored too
            starts = sorted({*starts, 0, len(ids)})
        return self._store_prompt(ids, starts, cache_salt)

    def warm_documents(self, documents: Sequence[str], *, cache_salt: str | None = None) -> list[WarmResult]:
        """Store each document alone, as it appears inside a chat prompt (tokenized without special tokens), by
        prefix and content key, its last partial chunk included: a chat prompt that marks it as a document (a
        content part, see :mod:`kvboost_hf.hf.chat_segments`) hits it at any position, in any order."""
        results = []
        for document in documents:
            ids = self._tokenize(document, add_special_tokens=False)
            results.append(self._store_prompt(ids, [0, len(ids)], cache_salt))
        return results

    def _store_prompt(self, ids: list[int], segment_starts: list[int], cache_salt: str | None) -> WarmResult:
        """Compute the K/V of ``ids`` and store them (by content key too when there are segments)."""
        self._check_length(len(ids), 1)
        puts_before = self.store.stats()["puts"]
        cache = self.new_cache(
            GenerationMode.CHUNK_KV_REUSE if segment_starts else GenerationMode.PREFIX_CACHE,
            cache_salt,
            segment_starts=segment_starts,
            adapter=False,
        )
        with self.lock:
            forward(self.model, cache, input_ids=torch.tensor([ids], device=self.device), logits_to_keep=1)
            cache.save(tail=True)
        spans = chunk_spans(ids, self.chunking, segment_starts=cache.segment_starts)
        covered = spans[-1][1] if spans else 0
        tail = len(ids) - covered
        partial = len(ids) % self.chunking.chunk_size if self.chunking.method == "fixed" else tail
        warning = None
        if tail:
            warning = (
                f"the last {tail} of {len(ids)} tokens do not fill a chunk of {self.chunking.chunk_size} and are not "
                "stored; later prompts recompute them"
            )
        elif partial:
            warning = (
                f"the last chunk holds {partial} tokens: it hits only where this text ends a segment; prompts that "
                "continue it in the same segment recompute those tokens"
            )
        return WarmResult(
            chunks_stored=self.store.stats()["puts"] - puts_before,
            token_count=len(ids),
            chunk_size=self.chunking.chunk_size,
            chunk_boundary_aligned=partial == 0,
            partial_tail_tokens=partial,
            alignment_warning=warning,
        )

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = 64,
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

        ``on_token`` receives each generated token id as soon as it exists; setting ``cancel`` stops generation
        (finish_reason ``"cancelled"``); ``logprobs=k`` returns each token's log-probability and the top ``k``
        (and the first token's logits); ``repair`` overrides the engine's repair settings for this call;
        ``sampling`` gives every decoding option the server has (top-k, min-p, penalties, logit bias, seed, ...);
        ``temperature``, ``do_sample``, ``top_p`` and ``seed`` are shorthands that build one (see
        :func:`sampling_params`; giving both is a ValueError). The same seed and settings give the same tokens
        here and from the server.
        """
        return self.generate_batch(
            [prompt],
            max_new_tokens,
            mode,
            temperature,
            do_sample,
            top_p,
            stop,
            seed=seed,
            cache_salt=cache_salt,
            cancel=cancel,
            logprobs=logprobs,
            repair=repair,
            sampling=sampling,
            on_token=None if on_token is None else (lambda row, token: on_token(token)),
        )[0]

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int = 64,
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
        the scheduler the server runs (:meth:`scheduler`: prompts that :meth:`batch_policy` prefills alone join the
        batch before its first decode step). Each row's greedy output equals what it gets alone, and every row is
        sampled with ``seed`` as if alone. ``on_token(row, token)`` is called as each token exists. With a draft
        every row is decoded speculatively; its tokens are those it gets without one. A row's TTFT is measured from
        the call (tokenizing included)."""
        started = time.perf_counter()
        if not prompts:
            raise InputError("prompts is empty")
        sampling = sampling_params(sampling, temperature=temperature, do_sample=do_sample, top_p=top_p, seed=seed)
        rows = self._rows(prompts, max_new_tokens, sampling, stop, cancel=cancel, logprobs=logprobs)
        # all rows start together, nothing runs that a prefill could pause: no token budget
        scheduler = self.scheduler(mode, max_batch_size=len(rows), token_budget=0, repair=repair)
        return self._run(scheduler, rows, range(len(rows)), mode, cache_salt, on_token, started)

    def generate_many(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int = 64,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
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
        """Generate for many prompts through the scheduler the server runs (:meth:`scheduler`), up to
        ``max_batch_size`` rows at a time: prompts are admitted shortest first, a new one joins the running batch
        as soon as a row leaves it (continuous batching), a segment prompt or one whose reuse needs a repair is
        prefilled alone and then decodes with the batch, and chunks stored by earlier rows are loaded by later
        ones; each step computes at most ``token_budget`` tokens (0: none), so a long prompt joining is prefilled
        in chunks between the running rows' steps. Options are :meth:`generate_batch`'s; input order is kept. A
        row's TTFT is measured from the call for the rows admitted first, from its admission for a row admitted
        later."""
        started = time.perf_counter()
        sampling = sampling_params(sampling, temperature=temperature, do_sample=do_sample, top_p=top_p, seed=seed)
        rows = self._rows(prompts, max_new_tokens, sampling, stop, cancel=cancel, logprobs=logprobs)
        order = sorted(range(len(rows)), key=lambda index: len(rows[index].request.prompt_ids))
        scheduler = self.scheduler(mode, max_batch_size=max_batch_size, token_budget=token_budget, repair=repair)
        return self._run(scheduler, rows, order, mode, cache_salt, on_token, started)

    def _rows(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int,
        sampling: SamplingConfig,
        stop: str | Sequence[str] | None,
        *,
        cancel: threading.Event | None,
        logprobs: int | None,
    ) -> list[DecodeRow]:
        """One decode row per prompt (tokenized with its segment starts) with the call's settings."""
        encoded = [self.encode_segments(prompt) for prompt in prompts]
        for ids, _ in encoded:
            self._check_length(len(ids), max_new_tokens)
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        requests = [
            DecodeRequest(
                prompt_ids=ids,
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                stop=stops,
                top_logprobs=logprobs,
                cancel=cancel,
                keep_first_logits=logprobs is not None,
                segment_starts=tuple(starts),
            )
            for ids, starts in encoded
        ]
        return self.new_rows(requests)

    def new_rows(self, requests: Sequence[DecodeRequest]) -> list[DecodeRow]:
        """One decode row per request, ending at this engine's end tokens; an unseeded request gets a seed from
        torch's global generator (so that ``torch.manual_seed`` before the call makes it repeatable)."""
        return DecodeLoop.rows_for(requests, self.eos_token_ids)

    def _run(
        self,
        scheduler: Scheduler,
        rows: Sequence[DecodeRow],
        order: Sequence[int],
        mode: GenerationMode | str,
        cache_salt: str | None,
        on_token: Callable[[int, int], None] | None,
        started: float,
    ) -> list[GenerationResult]:
        """Queue one request per row (in ``order``), step ``scheduler`` until all finished, and return the rows'
        results in input order (the first error a batch met is raised). A row's TTFT runs from ``started`` (the
        call, a ``time.perf_counter()`` value; tokenizing included) when it was admitted in the first step, else
        from its admission."""
        errors: list[BaseException] = []
        groups = [
            RequestGroup(
                [rows[index]],
                cache_salt,
                on_token=(lambda row: None) if on_token is None else functools.partial(_report_token, on_token, index),
                on_fail=errors.append,
            )
            for index in range(len(rows))
        ]
        for index in order:
            scheduler.add(groups[index])
        with self.lock:
            scheduler.run()
        if errors:
            raise errors[0]
        mode = GenerationMode(mode)
        first_admission = min((group.admitted_at or started for group in groups), default=started)
        starts = [started if group.admitted_at == first_admission else group.admitted_at or started for group in groups]
        return [self._result(group, mode, start) for group, start in zip(groups, starts, strict=True)]

    def scheduler(
        self,
        mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        batch_window_ms: float = 0.0,
        repair: RepairConfig | None = None,
        tokenizer_lock: contextlib.AbstractContextManager | None = None,
    ) -> Scheduler:
        """A :class:`~kvboost_hf.scheduling.Scheduler` for this engine: batches of this engine's decode loops
        (:meth:`decode_loop`) in ``mode``, at most ``max_batch_size`` rows running and ``token_budget`` tokens
        computed per step (0: no budget), a new batch formed once its oldest request waited ``batch_window_ms``;
        each batch's decode figures are added to :meth:`cache_stats`. The rows' text is decoded (special tokens
        skipped) under ``tokenizer_lock``. Step it under :attr:`lock`."""
        mode = GenerationMode(mode)

        def new_loop(key: BatchKey) -> DecodeLoop:
            return self.decode_loop(mode, key.cache_salt, repair)

        return Scheduler(
            self.batch_policy(mode),
            new_loop,
            decode=functools.partial(self.tokenizer.decode, skip_special_tokens=True),
            max_rows=max_batch_size,
            token_budget=token_budget,
            batch_window_s=batch_window_ms / 1e3,
            on_done=self.count_decode,
            tokenizer_lock=tokenizer_lock,
        )

    def decode_loop(
        self,
        mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
        cache_salt: str | None = None,
        repair: RepairConfig | None = None,
    ) -> DecodeLoop:
        """An empty decode loop (the scheduler's model runner) on this engine's model with fresh caches of these
        settings (no store with ``mode="baseline"``), speculative with the engine's draft when it has one. Its
        caller runs it under :attr:`lock`."""
        mode = GenerationMode(mode)
        new_cache: Callable[[tuple[int, ...]], ChunkReuseCache] | None = None
        if mode is not GenerationMode.BASELINE:
            new_cache = functools.partial(self.new_cache, mode, cache_salt, repair=repair, adapter=False)
        return DecodeLoop(
            self.model,
            new_cache=new_cache,
            pad_token_id=self.pad_token_id,
            draft=self._drafter(mode, cache_salt, repair),
            graphs=self.graphs,
        )

    def _drafter(self, mode: GenerationMode, cache_salt: str | None, repair: RepairConfig | None) -> Drafter | None:
        """The engine's drafter for one loop, or None without a draft. A draft model gets a chunk-reuse cache of
        its own (in its own engine's store when it is an engine) unless reuse is off; an early-exit draft (the
        target's first layers) a plain cache."""
        if not self.speculative:
            return None
        if self.draft_model is None:
            return Drafter(self.model, self.draft_settings, costs=self.verify_costs)
        draft_cache = None
        if mode is not GenerationMode.BASELINE:
            owner, model = (self._draft_engine, None) if self._draft_engine is not None else (self, self.draft_model)
            if repair is not None or owner is self:  # the draft only proposes: no APE attention adjustment there
                repair = replace(repair or self.repair, context_temperature=1.0, context_scale=1.0)
            draft_cache = functools.partial(
                owner.new_cache, mode, cache_salt, repair=repair, model=model, adapter=False
            )
        return Drafter(self.draft_model, self.draft_settings, draft_cache, self.verify_costs)

    def _result(self, group: RequestGroup, mode: GenerationMode, started: float) -> GenerationResult:
        """The :class:`GenerationResult` of a finished one-row group: times from ``started`` (a
        ``time.perf_counter()`` value), its batch's decode figures."""
        (row,) = group.rows
        batch = group.batch
        assert batch is not None and batch.decode_counts is not None, "the group ran in a batch that ended"
        streamed = batch.loop.streamed_bytes
        first = row.first_token_time or started
        finished = row.last_token_time or first
        prompt_ids = list(row.request.prompt_ids)
        tokens = row.tokens
        later = len(tokens) - 1
        logprobs = row.logprobs if row.request.top_logprobs is not None else None
        return GenerationResult(
            mode=mode.value,
            prompt=self.tokenizer.decode(prompt_ids),
            output_text=row.text,
            output_ids=list(tokens),
            generated_tokens=len(tokens),
            ttft_ms=(first - started) * 1e3,
            total_ms=(finished - started) * 1e3,
            tokens_per_sec=later / max(finished - first, 1e-9) if later > 0 else 0.0,
            kv_reuse_ratio=row.reuse.cached_tokens / len(prompt_ids),
            prompt_tokens=len(prompt_ids),
            cached_tokens=row.reuse.cached_tokens,
            approx_tokens=row.reuse.approx_tokens,
            recomputed_tokens=row.reuse.recomputed_tokens,
            first_token_logits=row.first_logits,
            finish_reason=row.finish_reason or "length",
            token_logprobs=None if logprobs is None else [entry.logprob for entry in logprobs],
            top_logprobs=None if logprobs is None else [list(entry.top) for entry in logprobs],
            **batch.decode_counts,
            streamed_bytes=streamed,
            streamed_bytes_per_token=None if streamed is None else streamed / max(len(tokens), 1),
        )

    def count_decode(self, loop: DecodeLoop) -> dict[str, Any]:
        """Decode figures of a finished loop (its rows share its target forwards) as :class:`GenerationResult`
        fields; also added to the engine's running totals (:meth:`cache_stats`). Call once per loop."""
        rows = loop.rows
        proposed = sum(row.draft_proposed for row in rows)
        accepted = sum(row.draft_accepted for row in rows)
        rejected = sum(row.draft_rejected for row in rows)
        longest = max((len(row.tokens) for row in rows), default=0)
        totals = self._decode_totals
        totals["generated_tokens"] += sum(len(row.tokens) for row in rows)
        totals["target_forwards"] += loop.forwards
        totals["verify_forwards"] += loop.verify_forwards
        totals["draft_tokens_proposed"] += proposed
        totals["draft_tokens_accepted"] += accepted
        totals["streamed_bytes"] += loop.streamed_bytes or 0
        drafted = loop.draft is not None and proposed > 0
        draft_reuse = loop.draft.cached_tokens if loop.draft is not None else []
        return {
            "target_forwards": loop.forwards,
            "tokens_per_target_forward": longest / loop.forwards if loop.forwards else 0.0,
            "verify_forwards": loop.verify_forwards,
            "draft_tokens_proposed": proposed,
            "draft_tokens_accepted": accepted,
            "draft_tokens_accepted_per_verify": accepted / loop.verify_forwards if drafted else None,
            "draft_acceptance_rate": accepted / proposed if drafted else None,
            "draft_position_acceptance": accepted / max(accepted + rejected, 1) if drafted else None,
            "draft_cached_tokens": draft_reuse[0] if draft_reuse else None,
        }

    @property
    def key_space(self) -> KeySpace:
        """What names this engine's chunks besides their tokens (its caches' :attr:`ChunkReuseCache.key_space`)."""
        return KeySpace.of_model(
            self.model,
            model_dtype(self.model),
            self.chunking,
            kv_cache_bits=self.store.kv_cache_bits,
            kv_group_size=self.store.kv_group_size,
        )

    def batch_policy(self, mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE) -> BatchPolicy:
        """Which requests may share a decode loop in ``mode`` (see :mod:`kvboost_hf.scheduling`)."""
        return BatchPolicy(self.store, self.key_space, mode)

    # ------------------------------------------------------------------ checks and stats
    def cache_stats(self, *, settle: bool = True) -> dict[str, int | float]:
        """Store counters (hits, misses, chunks, evictions, bytes per tier: ``ram_bytes``, ...); decode counters
        summed over this engine's calls (see :data:`DECODE_TOTALS`), with ``tokens_per_target_forward``,
        ``draft_tokens_accepted_per_verify`` and ``draft_acceptance_rate`` (0.0 before any draft proposal); with
        layer streaming also ``streamed_bytes_per_token`` (bytes streamed by decode calls / generated tokens) and the
        streamer's counters prefixed ``streaming_`` (see :class:`~kvboost_hf.offload.StreamingStats`, all copies
        included; ``settle=False`` reads its host-side counters only, never synchronising the device, as a thread
        other than the model's must); the prompt token ids cache's counters (``token_cache_*``:
        :meth:`~kvboost_hf.hf.tokens.SegmentTokenizer.stats`); the decode graphs' counters (``graph_*``:
        :meth:`~kvboost_hf.hf.graphs.GraphedDecoder.stats`)."""
        totals = self._decode_totals
        stats: dict[str, int | float] = {
            **self.store.stats(),
            **totals,
            "tokens_per_target_forward": totals["generated_tokens"] / max(totals["target_forwards"], 1),
            "draft_tokens_accepted_per_verify": totals["draft_tokens_accepted"] / max(totals["verify_forwards"], 1),
            "draft_acceptance_rate": totals["draft_tokens_accepted"] / max(totals["draft_tokens_proposed"], 1),
            **self.tokens.stats(),
            **{f"graph_{name}": value for name, value in self.graphs.stats().items()},
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
                eos_token_id=sorted(self.eos_token_ids) or None,
                pad_token_id=self.pad_token_id,
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

    # ------------------------------------------------------------------ internals
    @property
    def pad_token_id(self) -> int:
        """The id used for left padding (the tokenizer's pad token, else its EOS token, else 0)."""
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        return int(pad if pad is not None else 0)

    def left_pad(self, encoded: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)`` of a left-padded batch, on the model's device."""
        return left_pad(encoded, self.pad_token_id, self.device)

    @property
    def eos_token_ids(self) -> set[int]:
        """Token ids that end generation (the generation config's, else the tokenizer's)."""
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) - {None}


def _chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """``items`` checked as chat messages (a dict with a role and a content each); raises ValueError otherwise."""
    if not items or not all(isinstance(m, dict) and "role" in m and "content" in m for m in items):
        raise InputError(
            "a prompt must be a string, a non-empty list of segment strings, or a non-empty list of "
            "{'role': ..., 'content': ...} messages"
        )
    return items


def _token_ids(items: list[Any]) -> TypeGuard[list[int]]:
    """Whether a prompt given as a list is token ids (every item an int, not a bool)."""
    return bool(items) and all(isinstance(item, int) and not isinstance(item, bool) for item in items)


def _report_token(on_token: Callable[[int, int], None], index: int, row: DecodeRow) -> None:
    """``on_token(index, newest token)`` for a row of input ``index`` (called after each of its tokens)."""
    if row.tokens:
        on_token(index, row.tokens[-1])
