"""The base class of every error this package raises on purpose.

``except KVBoostError`` catches them all. Each typed error also keeps the builtin it has always derived from
(``ValueError`` for bad input, ``RuntimeError`` for a state that refuses the call), so code written as
``except ValueError`` keeps working.
"""


class KVBoostError(Exception):
    """Raised by kvboost_hf itself (never by a dependency it calls); subclasses name the failure."""
