"""Every error class the package defines sits under :class:`KVBoostError` and keeps its builtin base, and the
package raises no bare builtin exception (outside ``kvboost_hf/bench/``)."""

import ast
import builtins
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvboost_hf
from kvboost_hf import KVBoostError
from kvboost_hf.core.errors import (
    ArgumentTypeError,
    CapacityError,
    ConfigError,
    InputError,
    MissingDependencyError,
    MissingFileError,
    NotFoundError,
    StateError,
)
from kvboost_hf.hf.layers import CacheCapacityError
from kvboost_hf.hf.models import UnsupportedModelError
from kvboost_hf.offload import BudgetTooSmallError
from kvboost_hf.reuse.rope import UnsupportedRopeError
from kvboost_hf.server.grammar import GrammarBusy, GrammarError
from kvboost_hf.server.grammar_process import CompileFailed, CompileTimeout
from kvboost_hf.server.worker import Overloaded, ShuttingDown
from kvboost_hf.store.codec import CorruptEntryError
from kvboost_hf.tools import import_graph
from kvboost_hf.tools.awq_pack import CheckpointExistsError

ROOT = Path(__file__).resolve().parents[1]

#: Builtins the package may raise as they are: not errors a caller catches with ``except KVBoostError``.
ALLOWED_BUILTINS = {"SystemExit"}  # a command-line entry point's exit status (not even an ``Exception``)


def _package_exception_classes() -> list[type[BaseException]]:
    found = []
    for module_info in pkgutil.walk_packages(kvboost_hf.__path__, "kvboost_hf."):
        if module_info.name.endswith("__main__"):
            continue  # running it would start a program
        module = importlib.import_module(module_info.name)
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == module.__name__:
                found.append(value)
    return found


def test_every_package_exception_is_a_kvboost_error() -> None:
    classes = _package_exception_classes()
    assert len(classes) >= 11  # the walk found the package's errors, not an empty list
    # Starlette's HTTPException subclasses are answered by Starlette's own handler, which needs that class
    outside = [
        cls for cls in classes if not issubclass(cls, KVBoostError) and not issubclass(cls, StarletteHTTPException)
    ]
    assert outside == []


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (ConfigError, ValueError),
        (InputError, ValueError),
        (CapacityError, ValueError),
        (CacheCapacityError, CapacityError),
        (BudgetTooSmallError, CapacityError),
        (ArgumentTypeError, TypeError),
        (StateError, RuntimeError),
        (NotFoundError, LookupError),
        (MissingFileError, FileNotFoundError),
        (MissingDependencyError, ImportError),
        (CheckpointExistsError, FileExistsError),
        (UnsupportedModelError, ValueError),
        (UnsupportedRopeError, ValueError),
        (CorruptEntryError, ValueError),
        (GrammarError, ValueError),
        (GrammarBusy, RuntimeError),
        (CompileFailed, RuntimeError),
        (CompileTimeout, RuntimeError),
        (Overloaded, RuntimeError),
        (ShuttingDown, RuntimeError),
    ],
)
def test_typed_errors_keep_their_builtin_base(error: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(error, builtin)  # ``except ValueError`` written before the base class still catches it
    assert issubclass(error, KVBoostError)


def bare_builtin_raises(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of each ``raise`` in ``source`` whose exception is a builtin class itself (``raise
    ValueError(...)``, ``raise KeyError``): not one in :data:`ALLOWED_BUILTINS`, nor an ``AttributeError`` raised
    by a ``__getattr__`` (Python's attribute protocol asks for that class)."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Raise) and node.exc is not None:
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = raised.id if isinstance(raised, ast.Name) else ""
            value = getattr(builtins, name, None)
            builtin = isinstance(value, type) and issubclass(value, BaseException)
            protocol = name == "AttributeError" and function == "__getattr__"
            if builtin and name not in ALLOWED_BUILTINS and not protocol:
                found.append((node.lineno, name))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "")
    return found


def test_the_package_raises_no_bare_builtin_exception() -> None:
    modules = import_graph.discover_modules(ROOT)
    modules = {name: path for name, path in modules.items() if not name.startswith("kvboost_hf.bench")}
    assert "kvboost_hf.kernels.flash_attention" in modules and "kvboost_hf.engine" in modules
    raised = {name: found for name, path in modules.items() if (found := bare_builtin_raises(path.read_text()))}
    assert raised == {}


def test_the_raise_check_sees_a_bare_builtin() -> None:
    source = """
import errors

def f(x):
    if x:
        raise ValueError("x")
    raise errors.ConfigError("y") from None

def g():
    raise KeyError

def __getattr__(name):
    raise AttributeError(name)

def h():
    raise AttributeError("not the protocol")

raise SystemExit(0)
"""
    assert bare_builtin_raises(source) == [(6, "ValueError"), (10, "KeyError"), (16, "AttributeError")]


def test_typed_errors_are_caught_by_their_builtin() -> None:
    """A check that used to raise ``ValueError`` still meets ``except ValueError`` (and ``except KVBoostError``)."""
    from kvboost_hf.store.config import StoreConfig

    with pytest.raises(ValueError, match="max_bytes must be an integer >= 0") as caught:
        StoreConfig(max_bytes=-1)
    assert isinstance(caught.value, ConfigError)
