"""Write a quick int4 AWQ copy of a local model: round-to-nearest, asymmetric, per group of input channels.

Usage::

    python -m kvboost_hf.tools.awq_pack SRC_DIR DST_DIR [--group-size 64]

``SRC_DIR`` holds a Hugging Face checkpoint in safetensors (one file or shards with an index). Every 2-D weight
inside a decoder layer (``...layers.N...weight``: the attention and MLP projections) is quantized; embeddings,
norms, ``lm_head`` and biases are kept in float16. Mixture-of-experts models are refused. The output uses the AWQ
"GEMM" layout that transformers loads (through ``gptqmodel``, the ``awq`` extra) with ``quantization_config``
``{"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": true, "version": "gemm"}``:

* ``qweight`` int32 ``[in, out/8]``, ``qzeros`` int32 ``[in/G, out/8]``, ``scales`` float16 ``[in/G, out]``;
* nibble ``j`` (bits ``4j..4j+3``) of packed column ``c`` holds output column ``8c + AWQ_ORDER[j]``;
* ``weight[o, i] = (q[i, o] - zeros[i // G, o]) * scales[i // G, o]``.

There is no calibration (activation-aware scaling): this is plain round-to-nearest, a fast approximation
(SmolLM2-135M on 768 tokens of the bundled corpus: perplexity 14.1 in fp32, 18.1 after this packing). Each
group's range is widened to include zero and its fp16 scale rounded up, so every weight is within half a step.
Tensors are processed one at a time, so memory stays near the size of the largest tensor plus one output shard.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from kvboost_hf.core.errors import ConfigError, InputError, KVBoostError, MissingFileError
from kvboost_hf.kernels.awq_linear import AwqInt4Linear
from kvboost_hf.kernels.awq_reference import AWQ_ORDER, BITS, MAX_CODE, PACK, check_group_size, dequantize_awq

logger = logging.getLogger(__name__)

_LAYER_WEIGHT = re.compile(r"(^|\.)(layers|h|blocks)\.\d+\..*\.weight$")
RANDOM_ZERO = 8  # the zero point of random int4 layers: codes 0..15 stand for -8..7 steps


class CheckpointExistsError(KVBoostError, FileExistsError):
    """The destination folder already holds a checkpoint (packing never overwrites one)."""


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack int codes in ``[0, 15]`` of shape ``[rows, cols]`` (cols divisible by 8) into int32 ``[rows, cols/8]``
    in the AWQ GEMM nibble order."""
    rows, cols = codes.shape
    if cols % PACK:
        raise InputError(f"AWQ packing needs a column count divisible by {PACK}, got {cols}")
    if codes.min() < 0 or codes.max() > MAX_CODE:
        raise InputError("int4 codes must lie in [0, 15]")
    grouped = codes.to(torch.int64).reshape(rows, cols // PACK, PACK)
    packed = torch.zeros(rows, cols // PACK, dtype=torch.int64, device=codes.device)
    for nibble, column in enumerate(AWQ_ORDER):
        packed |= grouped[:, :, column] << (BITS * nibble)
    return (packed - ((packed >> 31) << 32)).to(torch.int32)  # two's complement into int32


def quantize_linear(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Round-to-nearest asymmetric int4 of a linear weight ``[out, in]``: ``qweight``, ``qzeros``, ``scales``."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise InputError(f"input size {in_features} is not divisible by group_size={group_size}")
    if out_features % PACK:
        raise InputError(f"output size {out_features} is not divisible by {PACK} (int4 codes per int32)")
    groups = weight.detach().float().t().reshape(in_features // group_size, group_size, out_features)
    low = groups.amin(dim=1).clamp(max=0.0)
    high = groups.amax(dim=1).clamp(min=0.0)
    exact = (high - low).clamp(min=1e-5) / MAX_CODE
    scales = exact.half()
    # round the stored scale up, so that the group's range still fits in 16 steps (error <= half a step)
    scales = torch.where(scales.float() < exact, torch.nextafter(scales, torch.full_like(scales, torch.inf)), scales)
    scale = scales.float()
    zeros = (-torch.round(low / scale)).clamp(0, MAX_CODE)
    codes = (torch.round(groups / scale[:, None]) + zeros[:, None]).clamp(0, MAX_CODE)
    return {
        "qweight": pack_int4(codes.reshape(in_features, out_features)),
        "qzeros": pack_int4(zeros),
        "scales": scales,
    }


def dequantize_linear(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int):
    """The float32 weight ``[out, in]`` (nn.Linear's layout) that an AWQ GEMM triple stands for."""
    return dequantize_awq(qweight, qzeros, scales, group_size).t()


@torch.no_grad()
def round_trip_int4(model: torch.nn.Module, group_size: int = 64) -> int:
    """Replace, in place, every decoder-layer linear weight of ``model`` by its int4 value (what
    :func:`pack_checkpoint` stores, dequantized into the weight's dtype): the int4 copy's function without an int4
    kernel. Returns how many weights were rounded. A mixture-of-experts model is refused."""
    refuse_mixture_of_experts(model.config)
    rounded = 0
    for name, parameter in model.named_parameters():
        if _LAYER_WEIGHT.search(name) and parameter.dim() == 2:
            packed = quantize_linear(parameter, group_size)
            parameter.copy_(dequantize_linear(packed["qweight"], packed["qzeros"], packed["scales"], group_size))
            rounded += 1
    return rounded


_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")  # Mixtral, Qwen MoE, DeepSeek


def refuse_mixture_of_experts(config: PretrainedConfig) -> None:
    """Raise :class:`ConfigError` for a mixture-of-experts model: its routers and gates would be quantized like
    projections (or refused for their few outputs) and its fused experts are not linears this int4 layout packs."""
    text_config = config.get_text_config(decoder=True)
    if any(getattr(text_config, count, None) for count in _EXPERT_COUNTS):
        raise ConfigError(
            f"{text_config.model_type} is a mixture-of-experts model: int4 AWQ packing and loading support dense "
            "models only"
        )


def _decoder_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """``(name, module)`` of every ``nn.Linear`` inside a decoder layer (what :func:`pack_checkpoint` quantizes) of
    a dense model (:func:`refuse_mixture_of_experts`)."""
    refuse_mixture_of_experts(model.config)
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and _LAYER_WEIGHT.search(f"{name}.weight")
    ]


def _swap(model: torch.nn.Module, name: str, replacement: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, replacement)


@torch.no_grad()
def int4_model(model: torch.nn.Module, group_size: int = 64) -> int:
    """Replace, in place, every decoder-layer ``nn.Linear`` of ``model`` by an :class:`AwqInt4Linear` holding its
    round-to-nearest int4 packing (the tensors :func:`pack_checkpoint` writes: scales and bias in float16), on the
    weight's device. Returns how many layers were replaced. The model then runs on the int4 kernel (Triton on CUDA)
    and a layer streamer copies packed bytes."""
    check_group_size(group_size)
    linears = _decoder_linears(model)
    for name, linear in linears:  # every layer checked before any is replaced: no half-converted model
        if linear.in_features % group_size or linear.out_features % PACK:
            raise InputError(
                f"{name} ({linear.in_features} -> {linear.out_features}) cannot be packed in groups of {group_size} "
                f"inputs and {PACK} outputs per int32; nothing was replaced"
            )
    for name, linear in linears:
        packed = {k: v.to(linear.weight.device) for k, v in quantize_linear(linear.weight, group_size).items()}
        bias = None if linear.bias is None else linear.bias.detach().half()
        _swap(model, name, AwqInt4Linear.from_packed(**packed, group_size=group_size, bias=bias))
    return len(linears)


def random_awq_linear(
    linear: torch.nn.Linear, group_size: int, words: torch.Tensor, std: float, device: torch.device | str
) -> AwqInt4Linear:
    """An :class:`AwqInt4Linear` of ``linear``'s shape (``in_features``, ``out_features``, bias or not) on
    ``device`` holding ``words`` (int32 ``[in, out/8]``) as its codes, zero point 8 and one float16 scale chosen so
    the weights' root mean square is ``std`` for uniform codes (codes minus 8: 4.64 steps); bias zeros."""
    in_features, out_features = linear.in_features, linear.out_features
    layer = AwqInt4Linear(in_features, out_features, group_size, linear.bias is not None, device=device)
    layer.qweight.copy_(words)
    layer.qzeros.copy_(pack_int4(torch.full((1, PACK), RANDOM_ZERO)).expand_as(layer.qzeros))
    step = std / (((MAX_CODE + 1) ** 2 - 1) / 12 + 0.25) ** 0.5  # uniform codes -8..7: mean square 21.5 steps^2
    layer.scales.fill_(step)
    return layer


@torch.no_grad()
def random_int4_layers(
    model: torch.nn.Module, group_size: int, *, seed: int = 0, std: float = 0.02, device: torch.device | str = "cpu"
) -> int:
    """Replace every decoder-layer linear of ``model`` (which may live on the meta device: nothing of the float
    weights is read but their shapes) by :func:`random_awq_linear` on ``device``; returns how many.

    Codes are drawn once per distinct shape (uniform int32 words from a CPU generator seeded with ``seed``) and each
    layer holds them XOR a random word of its own (uniform nibbles still, different in every layer, and a 32B shape
    is built in seconds instead of drawing 16 GB). Same ``seed``: the same packed bytes on every device."""
    generator = torch.Generator().manual_seed(seed)
    prototypes: dict[tuple[int, int], torch.Tensor] = {}
    linears = _decoder_linears(model)
    for name, linear in linears:
        shape = (linear.in_features, linear.out_features // PACK)
        if shape not in prototypes:
            drawn = torch.randint(-(2**31), 2**31, shape, generator=generator, dtype=torch.int64)
            prototypes[shape] = drawn.to(torch.int32).to(device)
        key = int(torch.randint(-(2**31), 2**31, (), generator=generator, dtype=torch.int64))
        _swap(model, name, random_awq_linear(linear, group_size, prototypes[shape] ^ key, std, device))
    return len(linears)


SHARD_INDEX = "model.safetensors.index.json"


def checkpoint_files(src: Path) -> list[str]:
    """Names of the safetensors files of the checkpoint in ``src`` (its shards, or ``model.safetensors``)."""
    index = src / SHARD_INDEX
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (src / "model.safetensors").exists():
        return ["model.safetensors"]
    raise MissingFileError(f"{src} holds no model.safetensors or model.safetensors.index.json")


def pack_checkpoint(src: str | Path, dst: str | Path, group_size: int = 64) -> Path:
    """Write the AWQ int4 copy of the dense checkpoint in ``src`` to ``dst`` (created; must not hold a checkpoint)."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise InputError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    refuse_mixture_of_experts(AutoConfig.from_pretrained(src))
    check_group_size(group_size)
    if (dst / "config.json").exists():
        raise CheckpointExistsError(f"{dst} already holds a checkpoint")
    dst.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(src)
    weight_map: dict[str, str] = {}
    quantized = 0
    for name in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(src / name, framework="pt") as reader:
            for key in tqdm(list(reader.keys()), desc=f"packing {name}", unit="tensor"):
                tensor = reader.get_tensor(key)
                if _LAYER_WEIGHT.search(key) and tensor.dim() == 2:
                    prefix = key[: -len(".weight")]
                    out.update({f"{prefix}.{k}": v for k, v in quantize_linear(tensor, group_size).items()})
                    quantized += 1
                else:
                    out[key] = tensor.half() if tensor.is_floating_point() else tensor
        save_file(out, dst / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, name))
    if quantized == 0:
        raise InputError(f"no decoder-layer linear weights found in {src}")
    if (src / SHARD_INDEX).exists():  # the packed shards keep the source's names, so they need an index too
        total = sum((dst / name).stat().st_size for name in files)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dst / SHARD_INDEX).write_text(json.dumps(index, indent=2))
    config["torch_dtype"] = config["dtype"] = "float16"
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": BITS,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    written = {"config.json", SHARD_INDEX, *files}  # the float shards must never replace the packed ones
    for extra in src.iterdir():
        if extra.is_file() and extra.name not in written and not extra.name.startswith("model.safetensors"):
            shutil.copy2(extra, dst / extra.name)
    logger.info("Packed %d linear weights of %s into %s (int4, group %d)", quantized, src, dst, group_size)
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvboost_hf.tools.awq_pack", description=__doc__.split("\n")[0])
    parser.add_argument("src", type=Path, help="local checkpoint directory (safetensors)")
    parser.add_argument("dst", type=Path, help="output directory")
    parser.add_argument("--group-size", type=int, default=64, help="input channels per scale/zero (default 64)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pack_checkpoint(args.src, args.dst, args.group_size)
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
