"""Result types returned by the engine (plain dataclasses, JSON-friendly through ``dataclasses.asdict``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationResult:
    """One generated completion. Times are milliseconds from the call; TTFT ends when the first generated
    token is available (synchronised on GPU), tokenisation, lookup and stitching included."""

    mode: str
    prompt: str
    output_text: str
    output_ids: list[int]
    generated_tokens: int
    ttft_ms: float
    total_ms: float
    tokens_per_sec: float  # decode rate: tokens after the first step / time from the first step to the end
    kv_reuse_ratio: float
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string), "length" or "cancelled"
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    first_token_logits: Any = None  # torch.Tensor [vocab] (fp32, CPU) when logprobs were requested
    approx_tokens: int = 0  # cached tokens that came from content-key (non-prefix) hits, not recomputed
    recomputed_tokens: int = 0  # loaded tokens recomputed by the repair
    # Decoding work (speculative decoding: the draft proposes, one target forward verifies several tokens).
    target_forwards: int = 0  # forwards of the target in this call, prefill included (a batch's rows share them)
    tokens_per_target_forward: float = 0.0  # generated tokens / target_forwards (1.0 for plain single-row decoding)
    verify_forwards: int = 0  # target forwards that verified draft tokens (each speculative step, the prompt's
    # forward when it verified the first tree; 0 without a draft)
    draft_tokens_proposed: int = 0  # draft tokens (tree nodes) the target verified, all rows of the batch
    draft_tokens_accepted: int = 0  # proposed tokens the target kept
    # draft_tokens_accepted / verify_forwards: each verify also yields one token of the target's own (None: no draft)
    draft_tokens_accepted_per_verify: float | None = None
    draft_acceptance_rate: float | None = None  # accepted / proposed; None when no draft was used
    # P(a draft token is accepted | the ones before it were): the a of (1 - a^(g+1)) / (1 - a) tokens per verify
    draft_position_acceptance: float | None = None
    draft_cached_tokens: int | None = None  # prompt tokens the draft loaded from the store (None: no draft cache)
    draft_forwards: int = 0  # forwards of the draft in this call (a batch's rows share them; 0 without a draft)
    streamed_bytes: int | None = None  # layer streaming only: bytes copied host to device by this call (batch's)
    streamed_bytes_per_token: float | None = None  # streamed_bytes / this row's generated tokens


@dataclass
class WarmResult:
    """What :meth:`~kvboost_hf.engine.InferenceEngine.warm` stored.

    ``chunks_stored`` counts every entry written: the full chunks and the unfinished last chunk (its
    ``partial_tail_tokens``, stored under its prefix key and reused by a prompt that continues the text with them);
    ``alignment_warning`` says where such a partial chunk hits.
    """

    chunks_stored: int
    token_count: int
    chunk_size: int
    chunk_boundary_aligned: bool
    partial_tail_tokens: int
    alignment_warning: str | None = None


@dataclass
class PromptCheck:
    """Greedy output with reuse vs transformers' own ``generate()`` for one prompt (logit difference: first step)."""

    prompt: str
    tokens_identical: bool
    first_differing_step: int | None
    max_logit_diff: float
    cached_tokens: int


@dataclass
class CorrectnessReport:
    """Truthy when every prompt produced, with reuse, the greedy tokens transformers' ``generate()`` produces."""

    checks: list[PromptCheck] = field(default_factory=list)

    def __bool__(self) -> bool:
        return all(check.tokens_identical for check in self.checks)

    @property
    def max_logit_diff(self) -> float:
        return max((check.max_logit_diff for check in self.checks), default=0.0)
