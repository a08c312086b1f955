"""Compile Triton kernels for a CUDA architecture without a GPU (ahead-of-time, through ``triton.compile``): what the
kernels' tests use to prove that every launch configuration builds and fits in shared memory."""

from __future__ import annotations

from collections.abc import Mapping

import triton

from kvboost_hf.core.errors import StateError

SHARED_MEMORY_BUDGET = 99 * 1024  # bytes per program: the smallest opt-in limit among sm_80+ GPUs (sm_86/89)


def compile_variant(
    kernel: triton.runtime.JITFunction,
    arch: int,
    types: dict[str, str],
    constants: Mapping[str, object],
    **options: int,
) -> None:
    """Compile ``kernel`` for ``sm_<arch>``: arguments named in ``constants`` are constexprs, the others typed by
    ``types`` (default ``i32``). Raises ``RuntimeError`` when the kernel is interpreted (TRITON_INTERPRET=1) or the
    variant needs more than :data:`SHARED_MEMORY_BUDGET` bytes of shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(kernel, triton.runtime.JITFunction):
        raise StateError("kernels are interpreted (TRITON_INTERPRET=1); compile in a process without it")
    names = kernel.arg_names
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in names}
    source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    if compiled.metadata.shared > SHARED_MEMORY_BUDGET:
        raise StateError(f"{kernel.__name__} {constants} needs {compiled.metadata.shared} B of shared memory")
