"""Load an AWQ GEMM int4 checkpoint without gptqmodel: its quantized linears become
:class:`~kvboost_hf.kernels.awq_linear.AwqInt4Linear` (the Triton kernel on CUDA, plain torch on CPU).

transformers routes ``quant_method="awq"`` through gptqmodel, whose kernels are compiled extensions (absent from
many GPU images). :func:`load_awq_model` reads the same files itself: the model is built on the meta device from the
config (its ``quantization_config`` dropped), every linear whose ``qweight`` the checkpoint holds is swapped for an
``AwqInt4Linear``, and the tensors are assigned from the safetensors files. Supported: 4 bits, zero point,
``version="gemm"`` (what ``tools/awq_pack.py`` writes and AutoAWQ's GEMM checkpoints hold).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel
from transformers.utils import GENERATION_CONFIG_NAME

from kvboost_hf.core.errors import InputError
from kvboost_hf.kernels.awq_linear import AwqInt4Linear
from kvboost_hf.kernels.awq_reference import BITS, check_group_size
from kvboost_hf.tools.awq_pack import checkpoint_files, refuse_mixture_of_experts


def rebuild_computed_buffers(model: PreTrainedModel, device: torch.device) -> int:
    """Fill on ``device`` every buffer of ``model`` still on the meta device (computed from the config, not stored:
    rotary inverse frequencies, Gemma's embedding scale) with the value the model's own initializer gives it, as
    transformers' ``from_pretrained`` does; the module stays in place and its loaded tensors are left as they are.
    Raises InputError naming a buffer the initializer does not compute. Returns how many modules were filled."""
    filled = 0
    for name, module in model.named_modules():
        computed = {key: buffer for key, buffer in module._buffers.items() if buffer is not None and buffer.is_meta}
        if not computed:
            continue
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            tensor._is_hf_initialized = True  # transformers' initializer skips these
        for key, meta in computed.items():
            if not meta.is_floating_point():
                raise InputError(f"{name}.{key}: no value for this buffer and no way to compute it")
            module._buffers[key] = torch.full_like(meta, torch.nan, device=device)  # NaN until computed
        with torch.no_grad():
            model._init_weights(module)
        unset = [key for key in computed if torch.isnan(module.get_buffer(key)).any()]
        if unset:
            raise InputError(f"{name} ({type(module).__name__}): the model's initializer does not compute {unset}")
        filled += 1
    return filled


def is_awq_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a local checkpoint folder whose config names ``quant_method="awq"``."""
    config = Path(path) / "config.json"
    if not config.exists():
        return False
    return (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method") == "awq"


def _awq_settings(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    settings = config.get("quantization_config") or {}
    wanted = {"quant_method": "awq", "bits": BITS, "zero_point": True, "version": "gemm"}
    found = {key: settings.get(key) for key in wanted}
    if found != wanted or not isinstance(settings.get("group_size"), int):
        raise InputError(f"{path} is not a 4-bit AWQ GEMM checkpoint with zero points: quantization_config {settings}")
    check_group_size(settings["group_size"])
    return settings


def load_awq_model(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float16
) -> PreTrainedModel:
    """The AWQ GEMM checkpoint in ``path`` as a model on ``device``: quantized linears as ``AwqInt4Linear`` (packed
    tensors and float16 scales as stored), every other floating tensor in ``dtype``, and the folder's
    ``generation_config.json`` when it has one. Raises InputError for another
    quantization, a checkpoint with no int4 linear, or one whose tensors do not fill the model; ConfigError for a
    mixture-of-experts model."""
    path, target = Path(path), torch.device(device)
    group_size = int(_awq_settings(path)["group_size"])
    config = AutoConfig.from_pretrained(path)
    refuse_mixture_of_experts(config)
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state: dict[str, torch.Tensor] = {}
    for name in checkpoint_files(path):
        with safe_open(path / name, framework="pt", device=str(target)) as reader:
            for key in reader.keys():  # noqa: SIM118 (a safetensors reader is not iterable)
                tensor = reader.get_tensor(key)
                keep = not tensor.is_floating_point() or key.endswith(".scales")
                state[key] = tensor if keep else tensor.to(dtype)
    swapped = 0
    for name, module in list(model.named_modules()):
        if f"{name}.qweight" in state and isinstance(module, torch.nn.Linear):
            layer = AwqInt4Linear(module.in_features, module.out_features, group_size, module.bias is not None,
                                  device="meta")  # fmt: skip
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer)
            swapped += 1
    if swapped == 0:
        raise InputError(f"{path}: its config names AWQ int4 but no linear layer of the model has a qweight tensor")
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if config.get_text_config(decoder=True).tie_word_embeddings:
        model.tie_weights()
        missing = [key for key in missing if not key.startswith("lm_head.")]
    if missing or unexpected:
        raise InputError(f"{path}: tensors missing {missing[:5]}, tensors unknown to the model {unexpected[:5]}")
    rebuild_computed_buffers(model, target)
    meta = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if meta:
        raise InputError(f"{path}: no values for {meta[:5]}")
    if (path / GENERATION_CONFIG_NAME).exists():  # stop tokens and sampling defaults, as from_pretrained reads them
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()
