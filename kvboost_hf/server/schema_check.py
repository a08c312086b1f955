"""A bounded check, in the server process, for JSON schemas that certainly cannot compile.

Compiles run in child processes behind a bounded queue (:mod:`~kvboost_hf.server.grammar_process`): under load a
compile is refused with 503 before any child looks at it. A schema that is certainly invalid must be a 400
whatever the load (clients retry a 503, not a 400), so :func:`certain_schema_problem` is asked first and its
answer never depends on the queue.

It reports only what xgrammar's JSON-schema converter refuses for every schema containing it (checked against
xgrammar in ``tests/test_schema_check.py``), and says nothing about the rest, which the children decide:

* a node with ``$ref`` or ``const`` is not looked into (xgrammar resolves the reference, or takes the constant,
  without reading the node's other keywords); a node with ``enum`` is refused unless ``enum`` is a non-empty array,
  and not looked into further;
* otherwise the first of ``anyOf``, ``oneOf`` and ``allOf`` present (in that order) must be an array; its items are
  nodes (an object or a boolean), and the node's other keywords are not looked at;
* otherwise ``type`` must be one of the seven JSON-schema type names, or an array of them, and
* under ``"type": "object"``: ``properties`` is an object of nodes, ``required`` an array of strings,
  ``additionalProperties`` a node;
* under ``"type": "array"``: ``items`` is a node, ``prefixItems`` an array of nodes.

Nodes are visited depth first, at most :data:`MAX_NODES` of them and :data:`MAX_DEPTH` deep; past either bound
the check stops and reports nothing (not certain). Cost: O(nodes visited), microseconds for typical schemas.
"""

from __future__ import annotations

from typing import Any

from kvboost_hf.core.errors import KVBoostError

MAX_NODES = 4096  # nodes looked at before the check gives up (says nothing)
MAX_DEPTH = 64  # nesting looked into before the check gives up
TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_COMBINATORS = ("anyOf", "oneOf", "allOf")  # the order in which the converter looks for them


def certain_schema_problem(schema: Any, path: str = "schema") -> str | None:
    """What makes ``schema`` (parsed JSON) certainly refused by the grammar compiler, or None when nothing is
    certain within the bounds (the compiler decides). The text names the offending keyword's path under
    ``path``."""
    budget = [MAX_NODES]
    try:
        return _node_problem(schema, path, 0, budget)
    except _GaveUp:
        return None


class _GaveUp(KVBoostError):
    """The bounds were reached: nothing certain (internal: never raised to a caller)."""


def _node_problem(node: Any, path: str, depth: int, budget: list[int]) -> str | None:
    """The problem of one schema node at ``path`` and of the nodes under it; ``budget[0]`` counts nodes left."""
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        raise _GaveUp
    if isinstance(node, bool):
        return None
    if not isinstance(node, dict):
        return f"{path} must be a JSON object or a boolean, not {_kind(node)}"
    if "$ref" in node or "const" in node:
        return None
    if "enum" in node:
        enum = node["enum"]
        if not isinstance(enum, list) or not enum:
            return f"{path}.enum must be a non-empty array"
        return None
    combinator = next((word for word in _COMBINATORS if word in node), None)
    children: list[tuple[Any, str]] = []
    if combinator is not None:  # the first one present is all the converter reads of the node
        items = node[combinator]
        if not isinstance(items, list):
            return f"{path}.{combinator} must be an array, not {_kind(items)}"
        children = [(item, f"{path}.{combinator}[{i}]") for i, item in enumerate(items)]
    else:
        declared = node.get("type")
        problem = _type_problem(declared, path)
        if problem is None and declared == "object":
            problem = _object_problem(node, path, children)
        elif problem is None and declared == "array":
            problem = _array_problem(node, path, children)
        if problem is not None:
            return problem
    for child, child_path in children:
        problem = _node_problem(child, child_path, depth + 1, budget)
        if problem is not None:
            return problem
    return None


def _type_problem(declared: Any, path: str) -> str | None:
    names = declared if isinstance(declared, list) else [declared] if declared is not None else []
    for name in names:
        if not isinstance(name, str):
            return f"{path}.type must be a type name or an array of them, not {_kind(name)}"
        if name not in TYPES:
            return f"{path}.type {name!r} is not one of {', '.join(sorted(TYPES))}"
    return None


def _object_problem(node: dict[str, Any], path: str, children: list[tuple[Any, str]]) -> str | None:
    """Problems of an object node's own keywords; its sub-nodes are appended to ``children``."""
    properties = node.get("properties", {})
    if not isinstance(properties, dict):
        return f"{path}.properties must be an object, not {_kind(properties)}"
    children += [(value, f"{path}.properties[{name!r}]") for name, value in properties.items()]
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        return f"{path}.required must be an array of strings"
    if "additionalProperties" in node:
        children.append((node["additionalProperties"], f"{path}.additionalProperties"))
    return None


def _array_problem(node: dict[str, Any], path: str, children: list[tuple[Any, str]]) -> str | None:
    """Problems of an array node's own keywords; its sub-nodes are appended to ``children``."""
    if "items" in node:
        children.append((node["items"], f"{path}.items"))
    prefix = node.get("prefixItems", [])
    if not isinstance(prefix, list):
        return f"{path}.prefixItems must be an array, not {_kind(prefix)}"
    children += [(item, f"{path}.prefixItems[{i}]") for i, item in enumerate(prefix)]
    return None


def _kind(value: Any) -> str:
    """The JSON kind of a parsed value, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"
