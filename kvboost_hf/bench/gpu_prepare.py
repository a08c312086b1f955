"""``python -m kvboost_hf.bench gpu --prepare DIR``: what a GPU machine without network needs, written to ``DIR``.

* ``DIR/whl``: cp312 manylinux wheels (``pip download --no-deps``) of every distribution that the package, its
  server extra and the benchmarks' clients need and that the device image lacks (:data:`IMAGE_HAS` and what those
  pull in are left out), pinned to the versions installed here; ``DIR/requirements.txt`` lists them;
* ``DIR/tokenizer``: the embedded model's tokenizer (3.4 MB), which the random-weight models use through
  ``KVBOOST_HF_TOKENIZER`` (the embedded model's 98 MB wheel does not travel);
* ``DIR/HOWTO.md``: the commands to run on the GPU machine.

Only the pip download needs the network. The project itself travels as the repository checkout.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

logger = logging.getLogger(__name__)

PYTHON = "3.12"  # the device image's interpreter
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")  # fmt: skip
# On the device image already (measured on the first GPU run, 2026-11-26), with everything they depend on.
IMAGE_HAS = ("torch", "triton", "accelerate", "tokenizers", "huggingface-hub", "numpy", "pytest", "hypothesis",
             "matplotlib")  # fmt: skip
# What the campaign imports: the package with its server extra, and the serve benchmark's client.
NEEDED = ("kvboost_hf[server]", "openai", "httpx", "pytest-timeout")
Runner = Callable[[Sequence[str]], object]


def _marker_environment() -> dict[str, str]:
    """Environment markers of the device image's interpreter (CPython 3.12 on x86-64 Linux)."""
    env = {key: str(value) for key, value in default_environment().items()}
    env.update(python_version=PYTHON, python_full_version=f"{PYTHON}.0", implementation_name="cpython",
               platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
               platform_machine="x86_64", os_name="posix")  # fmt: skip
    return env


def dependency_closure(roots: Iterable[str], stop: Iterable[str] = ()) -> dict[str, str | None]:
    """Canonical name -> version installed here (None: not installed) of ``roots`` (requirement strings, extras
    honoured) and everything they require on the device's interpreter, read from the installed metadata; names in
    ``stop`` are neither listed nor followed."""
    environment, skip = _marker_environment(), {canonicalize_name(name) for name in stop}
    found: dict[str, str | None] = {}
    pending = [Requirement(root) for root in roots]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in skip or name in found:
            continue
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            found[name] = None
            continue
        found[name] = distribution.version
        for text in distribution.requires or ():
            dependency = Requirement(text)
            extras = requirement.extras or {""}
            if dependency.marker is None or any(
                dependency.marker.evaluate({**environment, "extra": e}) for e in extras
            ):
                pending.append(dependency)
    return found


def wheel_requirements() -> list[str]:
    """``name==version`` (``name`` where it is not installed here) of every distribution to carry, sorted."""
    image = dependency_closure(IMAGE_HAS)
    needed = dependency_closure(NEEDED, stop=image)
    if needed.pop("kvboost-hf") is None:  # the project travels as source; its metadata names what it needs
        raise RuntimeError("kvboost_hf is not installed here (pip install -e .): its requirements are unknown")
    return sorted(name if version is None else f"{name}=={version}" for name, version in needed.items())


def download_command(requirements: Sequence[str], folder: Path) -> list[str]:
    """``pip download`` of ``requirements`` as binary wheels for the device's interpreter and platform."""
    platforms = [option for platform in PLATFORMS for option in ("--platform", platform)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON,
            "--implementation", "cp", *platforms, "--dest", str(folder), *requirements]  # fmt: skip


def howto(folder: str, calls: Sequence[Sequence[str]], megabytes: float, budget_s: float) -> str:
    """The commands to run on the GPU machine: ``folder`` is where the prepared files are (relative to the
    repository root there, or absolute), ``calls`` the campaign's steps grouped per device call, ``megabytes`` the
    prepared files' size."""
    tokenizer = f"{folder}/tokenizer" if folder.startswith("/") else f"$PWD/{folder}/tokenizer"
    runs = "\n".join(
        f"python3 -m kvboost_hf.bench gpu --budget-s {budget_s:.0f} --steps {','.join(steps)} \\\n"
        f"  --out {folder}/gpu --copy-to $OUT"
        for steps in calls
    )
    return f"""# Running `python -m kvboost_hf.bench gpu` on a GPU machine without network

Carry the repository checkout and `{folder}` (wheels and tokenizer, {megabytes:.0f} MB). On the device tool a folder
that git ignores travels only when named in `carry`. Then, from the repository root there, once per machine:

```bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
  --target /tmp/site {folder}/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD KVBOOST_HF_TOKENIZER={tokenizer}
ln -sfn ../kernels kvboost_hf/kernels  # without an install, kvboost_hf.kernels resolves only through this link
```

and one command per call (steps grouped so that their caps fit one call):

```bash
{runs}
```

Each command extends `{folder}/gpu/gpu.json` (on a fresh machine, put the previous call's `gpu.json` there first).
Check the first call's environment (`cuda_available`, versions, `tokenizer`) before the next.

Without `--model` every model-loading step uses random weights of a real shape: timings and mechanics only. Where a
real model exists on the machine, add `--model /path/to/model`: `multiturn`, `speculative` and `serve` then run on
it, and only those figures speak about acceptance and output fidelity.
"""


def write_tokenizer(folder: Path) -> Path:
    """Save the random-weight models' tokenizer (``KVBOOST_HF_TOKENIZER`` or the embedded model's) to ``folder``."""
    from transformers import AutoTokenizer

    from kvboost_hf.bench.shapes import tokenizer_dir

    AutoTokenizer.from_pretrained(tokenizer_dir()).save_pretrained(folder)
    return folder


def prepare(
    out: Path, calls: Sequence[Sequence[str]], budget_s: float, *, run: Runner | None = None, repository: Path
) -> list[str]:
    """Write the wheelhouse, the tokenizer and the how-to (``calls``: step names per device call, each within
    ``budget_s``) under ``out``; returns the requirements downloaded. ``run`` executes the pip command (default:
    ``subprocess.run(..., check=True)``); the how-to names ``out`` relative to ``repository`` when inside it."""
    out.mkdir(parents=True, exist_ok=True)
    requirements = wheel_requirements()
    (out / "requirements.txt").write_text("".join(f"{line}\n" for line in requirements))
    (out / "whl").mkdir(exist_ok=True)
    command = download_command(requirements, out / "whl")
    logger.info("downloading %d wheels: %s", len(requirements), " ".join(command))
    (run or (lambda argv: subprocess.run(argv, check=True)))(command)
    write_tokenizer(out / "tokenizer")
    where = out.resolve()
    if where.is_relative_to(repository.resolve()):
        where = where.relative_to(repository.resolve())
    megabytes = sum(path.stat().st_size for path in out.rglob("*") if path.is_file()) / 1e6
    (out / "HOWTO.md").write_text(howto(str(where), calls, megabytes, budget_s))
    return requirements
