"""The in-process check for schemas that certainly cannot compile (:mod:`kvboost_hf.server.schema_check`),
against xgrammar's converter as the oracle: every schema the check refuses, xgrammar refuses too (random
schemas), and the hand-written invalid schemas below are refused by both."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import xgrammar

from kvboost_hf.server.schema_check import MAX_DEPTH, certain_schema_problem


def _compiles(schema: Any) -> bool:
    try:
        xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except RuntimeError:
        return False
    return True


INVALID = [
    ({"type": "strnig"}, "schema.type 'strnig'"),
    ({"type": 5}, "schema.type must be"),
    ({"type": ["string", "bogus"]}, "'bogus'"),
    ({"type": "object", "properties": []}, "schema.properties must be an object"),
    ({"type": "object", "properties": {"a": 5}}, "schema.properties['a'] must be a JSON object"),
    ({"type": "object", "properties": {"a": {"type": "zzz"}}}, "schema.properties['a'].type 'zzz'"),
    ({"type": "object", "required": "a"}, "schema.required must be an array of strings"),
    ({"type": "object", "required": [5]}, "schema.required must be an array of strings"),
    ({"type": "object", "additionalProperties": 5}, "schema.additionalProperties must be"),
    ({"enum": "x"}, "schema.enum must be a non-empty array"),
    ({"enum": []}, "schema.enum must be a non-empty array"),
    ({"anyOf": 5}, "schema.anyOf must be an array"),
    ({"oneOf": [{}, {"type": "zzz"}]}, "schema.oneOf[1].type"),
    ({"allOf": [5]}, "schema.allOf[0] must be"),
    ({"type": "array", "items": [{}]}, "schema.items must be"),
    ({"type": "array", "prefixItems": {}}, "schema.prefixItems must be an array"),
    ({"type": "array", "items": {"type": "array", "items": {"type": "nul"}}}, "schema.items.items.type 'nul'"),
]


@pytest.mark.parametrize("schema, named", INVALID, ids=[json.dumps(s) for s, _ in INVALID])
def test_certainly_invalid_schemas_are_named(schema: dict, named: str):
    assert not _compiles(schema)  # the oracle: xgrammar refuses it
    problem = certain_schema_problem(schema)
    assert problem is not None and named in problem


VALID_OR_UNCERTAIN = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "zzz", "anyOf": [{"type": "string"}]},  # the converter reads the anyOf, not the type
    {"type": "zzz", "const": 1},  # nor the type beside a const
    {"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}, "type": "zzz"},
    {"type": "string", "properties": []},  # object keywords under another type are not read
    {"required": "a"},  # nor without a type
    {"oneOf": 5, "anyOf": [{}]},  # only the first combinator present is read
    {"not": {"type": "zzz"}},
    {"type": "string", "pattern": "("},  # invalid, but only the compiler knows: not certain here
]


@pytest.mark.parametrize("schema", VALID_OR_UNCERTAIN, ids=[json.dumps(s) for s in VALID_OR_UNCERTAIN])
def test_what_is_not_certain_is_left_to_the_compiler(schema: dict):
    assert certain_schema_problem(schema) is None


def test_the_bounds_make_it_uncertain_not_wrong():
    """Deeper than MAX_DEPTH (an invalid type at the bottom): nothing said; just inside it, said."""

    def nested(levels: int) -> dict:
        node: dict = {"type": "zzz"}
        for _ in range(levels):
            node = {"type": "array", "items": node}
        return node

    assert certain_schema_problem(nested(MAX_DEPTH)) is not None
    assert certain_schema_problem(nested(MAX_DEPTH + 1)) is None
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
    assert certain_schema_problem({**wide, "required": 5}) is not None  # own keywords before the children
    wide["properties"]["p9999"] = {"type": "zzz"}
    assert certain_schema_problem(wide) is None  # past MAX_NODES


_TYPES = ["string", "number", "integer", "boolean", "object", "array", "null", "zzz", 5, None, ["string", "object"], []]
_WORDS = ["properties", "required", "additionalProperties", "items", "prefixItems", "anyOf", "allOf", "oneOf", "enum"]
_WORDS += ["const", "$ref", "not", "minLength", "minimum"]


def _random_schema(rng: random.Random, depth: int = 0) -> Any:
    """A schema mixing valid and invalid keywords, up to 4 levels deep."""
    if depth and rng.random() < 0.05:
        return rng.choice([True, False, 5, "x", None, []])
    node: dict[str, Any] = {} if (kind := rng.choice(_TYPES)) is None else {"type": kind}
    deeper = depth < 3
    for word in rng.sample(_WORDS, rng.randint(0, 4)):
        if word == "properties":
            node[word] = rng.choice([[], 5, {f"p{i}": _random_schema(rng, depth + 1) for i in range(2 * deeper)}])
        elif word == "required":
            node[word] = rng.choice([[], ["p0"], "p0", [5], ["p0", "p9"]])
        elif word in ("additionalProperties", "items", "not"):
            node[word] = _random_schema(rng, depth + 1) if deeper else rng.choice([True, 5, {}])
        elif word in ("prefixItems", "anyOf", "allOf", "oneOf"):
            items = [_random_schema(rng, depth + 1) for _ in range(rng.randint(0, 2) * deeper)]
            node[word] = rng.choice([5, {}, items])
        elif word == "enum":
            node[word] = rng.choice([[], [1], "x", [1, "a"]])
        elif word == "$ref":
            node[word] = "#"
        else:
            node[word] = rng.choice([1, -1, "a", None])
    return node


def test_nothing_the_compiler_accepts_is_refused():
    """600 random schemas: each one the check refuses, xgrammar refuses too (and the check refuses a good share
    of them: it is not vacuous)."""
    rng = random.Random(40)
    refused = 0
    for _ in range(600):
        schema = _random_schema(rng)
        if certain_schema_problem(schema) is not None:
            refused += 1
            assert not _compiles(schema), schema
    assert refused >= 100
