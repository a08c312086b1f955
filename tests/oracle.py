"""Test oracles from transformers' own ``generate()``, independent of the project's decode loop and processors.

:func:`reference` runs ``model.generate`` on one prompt alone with a ``DynamicCache`` built from the model's config
(sliding-window layers included), never through :class:`~kvboost_hf.hf.decode.DecodeLoop`, and builds the logits
processors the way transformers does, from a ``GenerationConfig`` (:func:`generation_config`), never with the
project's ``build_processors``. A defect of the loop (positions, masks, token choice, stop handling) or of the way it
maps a request's settings to processors (which ones, their order, the prompt length they see) shows as a difference.

The one setting transformers lacks is OpenAI's presence/frequency penalty; :class:`OpenAIPenalties` implements it
here from OpenAI's definition (``logit -= frequency * count + presence * (count > 0)`` over the completion's tokens),
and ``generate`` runs it after its own processors (logit bias, repetition penalty, min new tokens) and before its
warpers (temperature, top-k, top-p, min-p), where OpenAI and vLLM apply it.

What matches exactly, and why:

* greedy: the argmax of the processed scores; for any batch position of the loop, since a greedy row equals itself
  alone;
* seeded sampling, one row: the server's and engine's seeded rows are specified (README, "The tests' oracle") to
  draw what ``generate`` draws for the prompt alone under ``torch.manual_seed(seed)``: transformers draws
  ``torch.multinomial(softmax(scores), 1)`` from torch's global CPU generator, the loop the same call from the row's
  own ``torch.Generator().manual_seed(seed)``, the same random stream. A loop row in a batch matches its prompt
  alone this way (its generator is its own); the server's choice ``i`` of a request uses ``seed + i``;
* what cannot match: transformers sampling a batch of several rows, which draws all rows from one global stream
  (row ``i`` of step ``t`` depends on every other row), so the oracle always runs one prompt alone.

:func:`cache_reference` is the oracle of a request whose reuse is approximate (content-key hits, repaired), where
no plain ``generate()`` gives the expected tokens: transformers' ``generate()`` drives a fresh drop-in
:class:`~kvboost_hf.hf.cache.ChunkReuseCache` on the engine's store for the prompt alone. The reuse plan and repair
are the library's, the generation loop is transformers' (no decode loop, no scheduler, no batch), so it checks that
batching, scheduling and joins keep a row's repair and tokens.

:func:`expected_text` turns the tokens into what the API returns: decoded without special tokens, cut before the
first occurrence of any stop string (OpenAI's ``stop``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from kvboost_hf.core.config import GenerationMode
from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.hf.prefill import RowReuse
from kvboost_hf.hf.sampling import SamplingConfig

GREEDY = SamplingConfig(temperature=0)


@dataclass(frozen=True)
class Reference:
    """transformers' output for one prompt: the generated ``tokens`` (an end token included, as the loop reports
    them), the raw logits of the first step ``[V]`` (fp32, CPU) and why it ended (``"stop"``: an end token,
    ``"length"``: the token budget)."""

    tokens: list[int]
    first_logits: torch.Tensor
    finish_reason: str


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the tokens after the first ``prompt_length`` ones of each row:
    ``logit[t] -= frequency * count(t) + presence * (count(t) > 0)``."""

    def __init__(self, presence: float, frequency: float, prompt_length: int) -> None:
        self.presence, self.frequency, self.prompt_length = presence, frequency, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        penalised = scores.clone()
        for row, ids in enumerate(input_ids[:, self.prompt_length :].tolist()):
            for token, count in Counter(ids).items():
                penalised[row, token] = scores[row, token] - self.frequency * count - self.presence
        return penalised


def is_greedy(sampling: SamplingConfig) -> bool:
    """OpenAI's rule: temperature 0 decodes greedily."""
    return sampling.temperature == 0


def end_tokens(sampling: SamplingConfig, eos_token_ids: Iterable[int]) -> list[int]:
    """The tokens that end a row: ``stop_token_ids``, and EOS unless ``ignore_eos`` (vLLM's semantics)."""
    return sorted(set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_token_ids)))


def generation_config(
    sampling: SamplingConfig, max_new_tokens: int, eos_token_ids: Iterable[int], pad_token_id: int
) -> GenerationConfig:
    """The ``GenerationConfig`` asking transformers for ``sampling`` (every sampling field set, so neither the
    model's generation config nor transformers' defaults, such as ``top_k=50``, add a warper)."""
    sampled = not is_greedy(sampling)
    ends = end_tokens(sampling, eos_token_ids)
    warpers = dict(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p if sampling.min_p > 0 else None,
    )
    return GenerationConfig(
        **(warpers if sampled else {}),
        do_sample=sampled,
        max_new_tokens=max_new_tokens,
        repetition_penalty=sampling.repetition_penalty,
        sequence_bias={(token,): bias for token, bias in sampling.logit_bias} or None,
        min_new_tokens=sampling.min_tokens or None,
        eos_token_id=ends or None,
        pad_token_id=pad_token_id,
        num_beams=1,
        return_dict_in_generate=True,
        output_logits=True,
    )


def reference(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingConfig = GREEDY,
    eos_token_ids: Iterable[int] = (),
    pad_token_id: int = 0,
) -> Reference:
    """What ``model.generate`` yields for ``prompt_ids`` alone under ``sampling`` (see the module docstring)."""
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    eos = list(eos_token_ids)
    config = generation_config(sampling, max_new_tokens, eos, pad_token_id)
    extra = LogitsProcessorList()
    if sampling.presence_penalty or sampling.frequency_penalty:
        extra.append(OpenAIPenalties(sampling.presence_penalty, sampling.frequency_penalty, len(prompt_ids)))
    if not is_greedy(sampling):
        if sampling.seed is None:
            raise ValueError("a sampled reference needs a seed to match")
        torch.manual_seed(sampling.seed)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=DynamicCache(config=model.config),
        generation_config=config,
        logits_processor=extra,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    ended = bool(tokens) and tokens[-1] in end_tokens(sampling, eos)
    return Reference(tokens, out.logits[0][0].float().cpu(), "stop" if ended else "length")


def engine_reference(engine, prompt, max_new_tokens: int, sampling: SamplingConfig = GREEDY) -> Reference:
    """:func:`reference` for an engine's prompt (strings, segments or chat messages), rendered and tokenised the way
    the engine does (``engine.encode``), with its EOS and pad ids."""
    prompts = engine.prompts
    return reference(
        engine.model, engine.encode(prompt), max_new_tokens, sampling, prompts.eos_token_ids, prompts.pad_token_id
    )


@dataclass(frozen=True)
class CacheReference:
    """transformers' greedy ``tokens`` for one prompt through a drop-in cache, and the ``reuse`` that cache reported
    for the prompt forward (prompt, cached, approximate and recomputed tokens)."""

    tokens: list[int]
    reuse: RowReuse


def cache_reference(engine, prompt, max_new_tokens: int, *, cache_salt: str | None = None) -> CacheReference:
    """What ``model.generate`` yields, greedy, for ``prompt`` alone (ids and segment starts as the engine encodes
    them) through a fresh :class:`ChunkReuseCache` on the engine's store, chunking and repair, in the mode
    ``chunk_kv_reuse``. It writes nothing back: the store is left as it was found."""
    ids, starts = engine.encode_segments(prompt)
    cache = ChunkReuseCache(
        engine.store,
        engine.model,
        engine.chunking,
        engine.repair,
        mode=GenerationMode.CHUNK_KV_REUSE,
        cache_salt=cache_salt,
        segment_starts=starts,
        write_back=False,
    )
    tensor = torch.tensor([ids], device=engine.model.device)
    config = generation_config(GREEDY, max_new_tokens, engine.prompts.eos_token_ids, engine.prompts.pad_token_id)
    out = engine.model.generate(tensor, attention_mask=torch.ones_like(tensor), cache=cache, generation_config=config)
    (reuse,) = cache.last_reuse  # the prompt forward's figures (one row)
    return CacheReference(out.sequences[0, len(ids) :].tolist(), reuse)


def expected_text(tokenizer, expected: Reference, stop: Sequence[str] = ()) -> str:
    """The text the API returns for ``expected``: its tokens decoded without special tokens, cut before the first
    occurrence of any of the ``stop`` strings."""
    text = tokenizer.decode(expected.tokens, skip_special_tokens=True)
    return text[: min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=len(text))]


def oracle_text(engine, prompt, max_new_tokens: int, sampling: SamplingConfig = GREEDY, stop=()) -> str:
    """The API's text for ``prompt`` from :func:`engine_reference` (greedy unless ``sampling``), cut at ``stop``."""
    return expected_text(engine.tokenizer, engine_reference(engine, prompt, max_new_tokens, sampling), stop)
