"""Every error class the package defines sits under :class:`KVBoostError` and keeps its builtin base."""

import importlib
import inspect
import pkgutil

import pytest
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvboost_hf
from kvboost_hf import KVBoostError
from kvboost_hf.hf.models import UnsupportedModelError
from kvboost_hf.reuse.rope import UnsupportedRopeError
from kvboost_hf.server.grammar import GrammarBusy, GrammarError
from kvboost_hf.server.grammar_process import CompileFailed, CompileTimeout
from kvboost_hf.server.worker import Overloaded, ShuttingDown
from kvboost_hf.store.codec import CorruptEntryError


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
