"""Re-rotating stored keys to new positions (non-prefix reuse).

Keys are stored RoPE-rotated. For the RoPE variants whose angle is linear in the position (default, linear,
llama3, yarn), moving a key from position ``p`` to ``p + d`` is an exact rotation by ``d``:
``k' = k * cos(d * theta) + partner(k) * sin(d * theta)``, where ``partner`` pairs channel ``i`` with ``i + D/2``
(Llama's ``rotate_half``) or with its neighbour (Cohere's interleaved pairs). YaRN multiplies cos and sin by an
attention factor; it is divided out here. Variants whose frequencies depend on the sequence length (dynamic NTK,
longrope) are refused: a stored key cannot be moved exactly. So is a model whose own rotary application (its
modeling module's ``apply_rotary_pos_emb``) neither layout reproduces: the rotator checks itself against it when
built, so a layout it does not know is refused instead of served wrong.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

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
    """Channel ``i`` paired with ``i + D/2`` (Llama's layout: cos and sin are ``cat(freqs, freqs)``)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Channel ``2j`` paired with ``2j + 1`` (Cohere's layout: cos and sin repeat each frequency twice)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


_PAIRINGS: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = (_rotate_half, _rotate_pairs)
_SELF_TEST_SHIFTS = (1, 37, -37)  # positions the construction self-test moves a probe key by
_SELF_TEST_TOLERANCE = 1e-4  # largest difference (float32, unit-scale probe) the self-test accepts


def _model_application(module: torch.nn.Module, interleaved: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The ``apply_rotary_pos_emb(q, k, cos, sin)`` of the modeling module that defines the rotary module (its
    ``apply_rotary_pos_emb_interleave`` when the config sets ``rope_interleave``, as DeepSeek's does)."""
    name = "apply_rotary_pos_emb_interleave" if interleaved else "apply_rotary_pos_emb"
    apply = getattr(sys.modules.get(type(module).__module__), name, None)
    if apply is None:
        raise UnsupportedRopeError(
            f"{type(module).__name__}: its modeling module has no {name} to check the key rotation "
            "against; non-prefix (approximate) reuse is disabled for this model"
        )
    return apply


def exact_reuse_length(model: torch.nn.Module) -> int | None:
    """Tokens a sequence may reach (padding included) for its K/V to be exact under a length-dependent RoPE: longrope
    keeps its short factors up to ``original_max_position_embeddings`` positions, dynamic NTK its base frequencies
    below ``max_position_embeddings``. Past that the frequencies depend on the forward's length (dynamic NTK: on
    earlier forwards too), so those K/V may be neither stored nor mixed with stored ones; and as transformers picks
    them from the largest position of a whole forward, no forward may hold positions past it beside positions at
    or below it. None when the frequencies do not depend on the length (or there is no rotary module). Found once
    per model."""
    if model not in _EXACT_LENGTHS:
        _EXACT_LENGTHS[model] = _exact_reuse_length(model)
    return _EXACT_LENGTHS[model]


_EXACT_LENGTHS: weakref.WeakKeyDictionary[torch.nn.Module, int | None] = weakref.WeakKeyDictionary()


def _exact_reuse_length(model: torch.nn.Module) -> int | None:
    try:
        module = _rotary_module(model)
    except UnsupportedRopeError:
        return None
    rope_type = str(getattr(module, "rope_type", "default"))
    if rope_type == "longrope":
        config: Any = module.config
        parameters = getattr(config, "rope_parameters", None) or {}
        return int(parameters.get("original_max_position_embeddings") or config.original_max_position_embeddings)
    if "dynamic" in rope_type:
        original: Any = module.original_max_seq_len
        return int(original) - 1
    return None


class KeyRotator:
    """Moves keys ``[..., tokens, head_dim]`` by a whole number of positions, with the model's own frequencies.

    With partial rotary embeddings only the first ``rotary_dim`` channels rotate. Built only for a model whose own
    rotary application it reproduces (checked on a probe key at a few shifts); raises
    :class:`UnsupportedRopeError` otherwise.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = _rotary_module(model)
        config = model.config.get_text_config(decoder=True)  # type: ignore[union-attr,operator]
        if getattr(config, "qk_nope_head_dim", None):
            raise UnsupportedRopeError(
                f"{config.model_type}: its rotary channels follow position-free ones (multi-head latent attention); "
                "non-prefix (approximate) reuse is disabled for this model"
            )
        rope_type = getattr(self.module, "rope_type", "default")
        if rope_type not in EXACT_ROPE_TYPES:
            raise UnsupportedRopeError(
                f"rope_type={rope_type!r}: its frequencies depend on the sequence length, so a stored key cannot "
                "be moved to another position exactly; non-prefix (approximate) reuse is disabled for this model"
            )
        self.scaling = float(getattr(self.module, "attention_scaling", 1.0))
        inv_freq: torch.Tensor = self.module.inv_freq  # type: ignore[assignment]
        self.rotary_dim = 2 * int(inv_freq.numel())
        apply = _model_application(self.module, bool(getattr(config, "rope_interleave", False)))
        self._partner = self._matching_pairing(apply, inv_freq.device)

    def _cos_sin(self, position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's ``cos, sin`` ``[rotary_dim]`` (float32) at ``position``, attention scaling included."""
        probe = torch.zeros(1, dtype=torch.float32, device=device)
        cos, sin = self.module(probe, torch.tensor([[position]], dtype=torch.long, device=device))
        return cos[0, 0].float(), sin[0, 0].float()

    def _matching_pairing(
        self, apply: Callable[..., tuple[torch.Tensor, torch.Tensor]], device: torch.device
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The channel pairing with which :meth:`rotate` moves a probe key as the model's own ``apply`` places it
        at each shift; raises :class:`UnsupportedRopeError` when neither pairing does."""
        probe = torch.randn(1, 1, 1, self.rotary_dim, generator=torch.Generator().manual_seed(0)).to(device)

        def placed(position: int) -> torch.Tensor:
            cos, sin = self._cos_sin(position, device)
            return apply(probe, probe, cos[None, None], sin[None, None])[1].float()

        try:
            at = {position: placed(position) for position in {0, *(abs(shift) for shift in _SELF_TEST_SHIFTS)}}
        except (TypeError, ValueError, RuntimeError, IndexError) as exc:
            raise UnsupportedRopeError(
                f"{type(self.module).__name__}: its apply_rotary_pos_emb cannot be checked on a probe key ({exc}); "
                "non-prefix (approximate) reuse is disabled for this model"
            ) from exc
        for self._partner in _PAIRINGS:
            if all(
                (self.rotate(at[max(0, -shift)], shift) - at[max(0, shift)]).abs().max() <= _SELF_TEST_TOLERANCE
                for shift in _SELF_TEST_SHIFTS
            ):
                return self._partner
        raise UnsupportedRopeError(
            f"{type(self.module).__name__}: moving a key by re-rotation does not reproduce the model's own rotary "
            "embedding (an unknown channel layout); non-prefix (approximate) reuse is disabled for this model"
        )

    def rotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """``keys`` moved ``delta`` positions later (earlier when negative); same dtype and device."""
        if delta == 0:
            return keys
        cos, sin = self._cos_sin(delta, keys.device)
        cos, sin = cos / self.scaling, sin / self.scaling
        rot, rest = keys[..., : self.rotary_dim].float(), keys[..., self.rotary_dim :]
        moved = (rot * cos + self._partner(rot) * sin).to(keys.dtype)
        return moved if rest.shape[-1] == 0 else torch.cat([moved, rest], dim=-1)
