"""The errors this package raises on purpose: one base class, a few groups under it.

``except KVBoostError`` catches them all. Each group also keeps the builtin the package raised before it had
typed errors, so code written as ``except ValueError`` (or ``TypeError``, ``RuntimeError``, ...) keeps working:

* :class:`ConfigError` (``ValueError``): a setting or option is out of range, unknown, or contradicts another
  one (settings dataclasses, constructor arguments);
* :class:`InputError` (``ValueError``): the data handed to a call cannot be used: an empty or malformed prompt or
  request, tensors of the wrong shape or dtype, a cache or checkpoint of another kind;
* :class:`CapacityError` (``ValueError``): the data is larger than a fixed capacity or a memory budget;
* :class:`UnsupportedModelError` (``ValueError``): a model whose K/V cannot be reused chunk by chunk;
* :class:`ArgumentTypeError` (``TypeError``): an argument of a type the call does not take;
* :class:`StateError` (``RuntimeError``): an object's state refuses the call (closed, busy, mid-operation,
  inconsistent);
* :class:`NotFoundError` (``LookupError``): a named thing (a replica, a module's layer) is not there;
* :class:`MissingFileError` (``FileNotFoundError``): a file the call needs is absent;
* :class:`MissingDependencyError` (``ImportError``): an optional package or a platform property is missing.

Narrower errors derive from these (``CacheCapacityError`` from :class:`CapacityError`, ...) or, where a
module's callers tell its failures apart, sit next to the code that raises them. ``tests/test_errors.py`` parses
the package and fails on a ``raise`` of a bare builtin outside ``kvboost_hf/bench/``.
"""


class KVBoostError(Exception):
    """Raised by kvboost_hf itself (never by a dependency it calls); subclasses name the failure."""


class ConfigError(KVBoostError, ValueError):
    """A setting or option is out of range, unknown, or contradicts another one."""


class InputError(KVBoostError, ValueError):
    """The data handed to a call (prompt, request, tensors, cache, checkpoint) cannot be used as given."""


class CapacityError(KVBoostError, ValueError):
    """The data is larger than a fixed capacity (rows, columns, tokens) or a memory budget allows."""


class UnsupportedModelError(KVBoostError, ValueError):
    """Raised for a model whose K/V cannot be reused chunk by chunk."""


class ArgumentTypeError(KVBoostError, TypeError):
    """An argument of a type the call does not take."""


class StateError(KVBoostError, RuntimeError):
    """The object's state refuses the call: it is closed, busy, mid-operation or found inconsistent."""


class NotFoundError(KVBoostError, LookupError):
    """A named thing the call looks up is not there."""


class MissingFileError(KVBoostError, FileNotFoundError):
    """A file the call needs is absent."""


class MissingDependencyError(KVBoostError, ImportError):
    """An optional package, or a property of the platform, that the call needs is missing."""
