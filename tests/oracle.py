"""Test oracles from transformers' own ``generate()``, independent of the project's decode loop.

:func:`reference` runs ``model.generate`` on one prompt alone with a ``DynamicCache`` built from the model's config
(sliding-window layers included), never through :class:`~kvboost_hf.hf.decode.DecodeLoop`, so a defect the loop's
modes share (positions, masks, processors, token choice) shows up as a difference.

What matches exactly, and why:

* greedy: the argmax of transformers' processed scores; for any batch position of the loop, since a greedy row
  equals itself alone;
* seeded sampling, one row: transformers draws ``torch.multinomial(softmax(scores), 1)`` from torch's global
  generator, the loop draws the same call from the row's own ``torch.Generator().manual_seed(seed)``; with
  ``torch.manual_seed(seed)`` right before ``generate`` and the row's processors
  (:func:`~kvboost_hf.hf.sampling.build_processors`) passed as ``logits_processor`` (generate's own warpers off),
  both consume the same CPU random stream, so every draw is the same. A loop row in a batch matches its prompt
  alone this way (its generator is its own);
* what cannot match: transformers sampling a batch of several rows, which draws all rows from one global stream
  (row ``i`` of step ``t`` depends on every other row), so the oracle always runs one prompt alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from kvboost_hf.hf.sampling import SamplingConfig, build_processors

GREEDY = SamplingConfig(temperature=0)


@dataclass(frozen=True)
class Reference:
    """transformers' output for one prompt: the generated ``tokens`` (an end token included, as the loop reports
    them) and the raw logits of the first step ``[V]`` (fp32, CPU)."""

    tokens: list[int]
    first_logits: torch.Tensor


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
    eos = sorted(eos_token_ids)
    ends = sorted(sampling.end_token_ids(eos))
    if not sampling.greedy:
        if sampling.seed is None:
            raise ValueError("a sampled reference needs a seed to match")
        torch.manual_seed(sampling.seed)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        past_key_values=DynamicCache(config=model.config),
        max_new_tokens=max_new_tokens,
        do_sample=not sampling.greedy,
        logits_processor=build_processors(sampling, len(prompt_ids), eos),
        temperature=None,
        top_k=None,
        top_p=None,
        eos_token_id=ends or None,
        pad_token_id=pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return Reference(out.sequences[0, len(prompt_ids) :].tolist(), out.logits[0][0].float().cpu())


def engine_reference(engine, prompt, max_new_tokens: int, sampling: SamplingConfig = GREEDY) -> Reference:
    """:func:`reference` for an engine's prompt (strings, segments or chat messages), rendered and tokenised the way
    the engine does (``engine.encode``), with its EOS and pad ids."""
    return reference(
        engine.model, engine.encode(prompt), max_new_tokens, sampling, engine.eos_token_ids, engine.pad_token_id
    )
