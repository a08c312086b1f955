"""Re-rotating stored keys to new positions (non-prefix reuse).

Keys are stored RoPE-rotated. For the RoPE variants whose angle is linear in the position (default, linear,
llama3, yarn), moving a key from position ``p`` to ``p + d`` is an exact rotation by ``d``:
``k' = k * cos(d * theta) + rotate_half(k) * sin(d * theta)``. YaRN multiplies cos and sin by an attention factor;
it is divided out here. Variants whose frequencies depend on the sequence length (dynamic NTK, longrope) are
refused: a stored key cannot be moved exactly.
"""

from __future__ import annotations

import torch

from kvboost_hf.core.errors import KVBoostError

EXACT_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


class UnsupportedRopeError(KVBoostError, ValueError):
    """Raised for a model whose keys cannot be moved to new positions exactly."""


def _rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and hasattr(module, "inv_freq"):
            return module
    raise UnsupportedRopeError(f"{type(model).__name__} has no rotary embedding module: keys cannot be re-rotated")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KeyRotator:
    """Moves keys ``[..., tokens, head_dim]`` by a whole number of positions, with the model's own frequencies.

    With partial rotary embeddings only the first ``rotary_dim`` channels rotate.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = _rotary_module(model)
        rope_type = getattr(self.module, "rope_type", "default")
        if rope_type not in EXACT_ROPE_TYPES:
            raise UnsupportedRopeError(
                f"rope_type={rope_type!r}: its frequencies depend on the sequence length, so a stored key cannot "
                "be moved to another position exactly; non-prefix (approximate) reuse is disabled for this model"
            )
        self.scaling = float(getattr(self.module, "attention_scaling", 1.0))
        inv_freq: torch.Tensor = self.module.inv_freq  # type: ignore[assignment]
        self.rotary_dim = 2 * int(inv_freq.numel())

    def rotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """``keys`` moved ``delta`` positions later (earlier when negative); same dtype and device."""
        if delta == 0:
            return keys
        probe = torch.zeros(1, dtype=torch.float32, device=keys.device)
        position = torch.tensor([[delta]], dtype=torch.long, device=keys.device)
        cos, sin = self.module(probe, position)
        cos, sin = cos[0, 0] / self.scaling, sin[0, 0] / self.scaling
        rot, rest = keys[..., : self.rotary_dim].float(), keys[..., self.rotary_dim :]
        moved = (rot * cos + _rotate_half(rot) * sin).to(keys.dtype)
        return moved if rest.shape[-1] == 0 else torch.cat([moved, rest], dim=-1)
