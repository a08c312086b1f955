"""Per-row token choice on transformers' logits processors.

:func:`build_processors` turns one request's OpenAI-style sampling settings into a transformers
``LogitsProcessorList`` (usable by ``generate(logits_processor=...)`` as well as by a decode loop of one's own), and
:func:`choose_token` picks the next token of one row from the processed scores with that row's generator
(:func:`choose_tokens`: of several rows, with one wait on the device for all of them).

Invariants: processors see ``input_ids`` = prompt + generated tokens of one row (``[1, L]``) and scores ``[1, V]``;
penalties that OpenAI defines on the completion (presence, frequency) skip the prompt, ``repetition_penalty`` covers
prompt and completion (as in transformers and vLLM); a greedy row (temperature below :data:`GREEDY_BELOW_TEMPERATURE`)
takes the argmax and never divides by its temperature.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvboost_hf.core.errors import ConfigError
from kvboost_hf.core.values import is_finite, is_integer

GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings of one row.

    ``temperature`` 0 = greedy; ``top_k`` 0 = off; ``min_p`` 0 = off; ``presence_penalty`` / ``frequency_penalty``
    are subtracted from the logit of every token already generated (once / per occurrence, OpenAI semantics);
    ``repetition_penalty`` > 1 divides positive (multiplies negative) logits of tokens seen in prompt or output;
    ``logit_bias`` pairs ``(token id, bias)`` are added to the logits; ``min_tokens`` bans the end tokens (EOS and
    ``stop_token_ids``) until that many tokens exist; ``stop_token_ids`` end the row like EOS; with ``ignore_eos``
    EOS neither ends the row nor is banned by ``min_tokens`` (vLLM's semantics; transformers' ``min_new_tokens``
    bans what its ``eos_token_id`` names); ``seed`` seeds the row's generator (None = random).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        """Refuse a setting outside its range (:class:`~kvboost_hf.core.errors.ConfigError` naming it): a negative
        temperature or a top-p over 1 would otherwise decode as something the caller did not ask for.
        ``logit_bias`` may be given as a ``{token id: bias}`` dict (OpenAI's form), the sequences as lists or None: they
        are kept as tuples (in the order given)."""
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else _listed(self.logit_bias)
        object.__setattr__(self, "logit_bias", tuple(_listed(pair) for pair in bias))
        object.__setattr__(self, "stop_token_ids", _listed(self.stop_token_ids))
        problems = [
            f"{name}={value!r} must be {rule}"
            for name, value, rule, ok in (
                ("temperature", self.temperature, ">= 0", is_finite(self.temperature) and self.temperature >= 0),
                ("top_p", self.top_p, "in (0, 1]", is_finite(self.top_p) and 0 < self.top_p <= 1),
                ("top_k", self.top_k, "an integer >= 0", is_integer(self.top_k) and self.top_k >= 0),
                ("min_p", self.min_p, "in [0, 1]", is_finite(self.min_p) and 0 <= self.min_p <= 1),
                ("presence_penalty", self.presence_penalty, "finite", is_finite(self.presence_penalty)),
                ("frequency_penalty", self.frequency_penalty, "finite", is_finite(self.frequency_penalty)),
                (
                    "repetition_penalty",
                    self.repetition_penalty,
                    "> 0",
                    is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
                ),
                (
                    "logit_bias",
                    self.logit_bias,
                    "(token id >= 0, finite bias) pairs",
                    all(len(p) == 2 and is_integer(p[0]) and p[0] >= 0 and is_finite(p[1]) for p in self.logit_bias),
                ),
                (
                    "min_tokens",
                    self.min_tokens,
                    "an integer >= 0",
                    is_integer(self.min_tokens) and self.min_tokens >= 0,
                ),
                (
                    "stop_token_ids",
                    self.stop_token_ids,
                    "token ids >= 0",
                    all(is_integer(t) and t >= 0 for t in self.stop_token_ids),
                ),
                (
                    "seed",
                    self.seed,
                    "an integer in [-2**63, 2**64) or None",
                    self.seed is None or (is_integer(self.seed) and -(2**63) <= self.seed < 2**64),
                ),
            )
            if not ok
        ]
        if problems:
            raise ConfigError("SamplingConfig: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def end_token_ids(self, eos_token_ids: Iterable[int]) -> set[int]:
        """Token ids that end this row: the stop ids, plus EOS unless ``ignore_eos``."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))


SamplingParams = SamplingConfig  # the name of earlier versions, still in README examples


def _listed(value: object) -> tuple:
    """``value`` as a tuple: a list or tuple's items, () for None, else the value alone (for the checks to name)."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's additive penalties over the generated tokens only (``input_ids[:, prompt_length:]``):
    ``logit -= frequency * count + presence * (count > 0)``."""

    def __init__(self, presence: float, frequency: float, prompt_length: int) -> None:
        self.presence, self.frequency, self.prompt_length = presence, frequency, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_length :]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def build_processors(
    params: SamplingConfig,
    prompt_length: int,
    eos_token_ids: Iterable[int],
    constraints: Sequence[LogitsProcessor] = (),
) -> LogitsProcessorList:
    """The row's processors, in this order: logit bias, repetition / presence / frequency penalties, min_tokens,
    ``constraints`` (e.g. a grammar mask), then (sampling rows only) temperature, top-k, top-p, min-p.

    ``prompt_length`` is the number of prompt tokens at the start of the ``input_ids`` the processors will see.
    """
    processors = LogitsProcessorList()
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor([[[token], bias] for token, bias in params.logit_bias]))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(PresenceFrequencyPenalty(params.presence_penalty, params.frequency_penalty, prompt_length))
    if params.min_tokens > 0:
        ends = sorted(params.end_token_ids(eos_token_ids))  # EOS is an ordinary token with ignore_eos: not banned
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, params.min_tokens, ends))
    processors.extend(constraints)
    if not params.greedy:
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            processors.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(params.top_p))
        if params.min_p > 0.0:
            processors.append(MinPLogitsWarper(params.min_p))
    return processors


IDS_FREE_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)
"""Processors whose output depends on the scores alone (the ``input_ids`` they are handed go unread)."""


def reads_input_ids(processors: Sequence[LogitsProcessor]) -> bool:
    """Whether any of ``processors`` reads the ``input_ids`` it is handed (penalties, min_tokens, constraints, logit
    bias): a row without one need not send its whole context to the device at every step."""
    return any(not isinstance(processor, IDS_FREE_PROCESSORS) for processor in processors)


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """The greedy choice of each row, ``[..., V]`` -> ``[...]`` on the scores' device: the argmax (the first of equal
    maxima, as :func:`choose_token` takes it)."""
    return scores.argmax(dim=-1)


def choose_token(scores: torch.Tensor, params: SamplingConfig, generator: torch.Generator) -> int:
    """The next token of one row from its processed scores ``[1, V]``: argmax when greedy, else a draw from the
    softmax with ``generator``, a CPU generator whatever the scores' device (the probabilities are moved to the
    CPU for the draw, so a seed gives the same draws on every device). Scores of +inf (a repetition penalty near
    0 divides a positive logit into overflow) take the softmax's limit: those tokens alone, equally likely. Raises
    ConfigError when the processors left no token allowed or gave a NaN score."""
    return choose_tokens(scores, [params], [generator])[0]


def choose_tokens(
    scores: torch.Tensor, params: Sequence[SamplingConfig], generators: Sequence[torch.Generator]
) -> list[int]:
    """:func:`choose_token` for each row of ``scores`` ``[N, V]`` (processed; row ``i`` with ``params[i]`` and
    ``generators[i]``), the same tokens with one transfer to the host for all rows (their maxima, argmaxes and,
    when one samples, every row's probabilities) instead of two waits per row."""
    scores = scores.float()
    tops = scores.max(dim=-1).values  # NaN if any score is NaN, -inf if every token is masked
    overflowed = (tops == math.inf)[:, None]
    scores = torch.where(overflowed, torch.where(scores == math.inf, 0.0, -math.inf), scores)
    parts = [tops[:, None], greedy_tokens(scores).float()[:, None]]  # ids < 2**24: exact in float32
    if not all(each.greedy for each in params):
        parts.append(torch.softmax(scores, dim=-1))
    host_tops, host_ids, *host_probs = _on_host(parts)
    chosen = []
    for row, (each, generator) in enumerate(zip(params, generators, strict=True)):
        top = float(host_tops[row, 0])
        if math.isnan(top):
            raise ConfigError("the sampling settings gave a NaN score (e.g. a penalty that overflows the logits)")
        if top == -math.inf:
            raise ConfigError("every token is masked: the sampling settings and constraints exclude each other")
        if each.greedy:
            chosen.append(int(host_ids[row, 0]))
        else:
            chosen.append(int(torch.multinomial(host_probs[0][row], 1, generator=generator)))
    return chosen


def _on_host(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``parts`` (``[N, *]`` each, one device) on the host: as they are on a CPU, else in one transfer (the one
    wait on the device)."""
    if parts[0].device.type == "cpu":
        return parts
    widths = [part.shape[1] for part in parts]
    return list(torch.cat(parts, dim=1).cpu().split(widths, dim=1))
