"""Command-line flags generated from settings dataclasses, so every field has a flag and one default.

:func:`add_settings_arguments` registers one flag per field of a frozen settings dataclass (``field_name`` ->
``--field-name``, or a name given in ``names``): the type comes from the annotation (``X | None`` accepts ``X``;
an :class:`~enum.Enum` gives the enum's values as choices; ``bool`` gives ``--flag/--no-flag``), the default is the
field's own default and the help text is the field's entry in the class docstring. :func:`settings_from_args`
builds the dataclass back from the parsed namespace. A ``tuple[int, ...]`` field takes comma-separated integers
(``--row-buckets 1,2,4``; an empty value gives ``()``). Parsing no flags therefore gives exactly the dataclass's
defaults: the defaults live on the dataclass only.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import itertools
import os
import re
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from kvboost_hf.core.errors import ArgumentTypeError

T = TypeVar("T")

_SCALARS = (int, float, str)


def integers(text: str) -> tuple[int, ...]:
    """A ``tuple[int, ...]`` flag's value: ``"1,2,4"`` -> ``(1, 2, 4)``, ``""`` -> ``()`` (a ValueError, which
    argparse reports as an invalid value, for anything else)."""
    return tuple(int(part) for part in text.split(",") if part.strip())


def _flag_type(annotation: Any) -> tuple[Callable[[str], Any], bool]:
    """The type a flag parses (int, float, str, bool, an Enum, or :func:`integers` for ``tuple[int, ...]``) for
    ``annotation``, and whether None is allowed.

    A union of several types parses the first one that is an Enum, else int/float/str in that order (paths,
    devices and secrets are given as strings). Raises TypeError for a field no flag can express.
    """
    if typing.get_origin(annotation) is tuple and typing.get_args(annotation) == (int, ...):
        return integers, False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        optional = len(members) < len(args)
    else:
        members, optional = [annotation], False
    for member in members:
        if isinstance(member, type) and issubclass(member, enum.Enum):
            return member, optional
    for scalar in (bool, *_SCALARS):
        if scalar in members:
            return scalar, optional
    if any(member is os.PathLike or typing.get_origin(member) is os.PathLike for member in members):
        return str, optional
    raise ArgumentTypeError(f"no command-line flag for a field of type {annotation!r}")


def field_help(cls: type) -> dict[str, str]:
    """Each field's help: the first line of its entry in ``cls``'s docstring (``name: text`` or ``name, other:
    text``), else the first sentence of the string literal that follows the field in the class body (an attribute
    docstring)."""
    found: dict[str, str] = {}
    for line in (cls.__doc__ or "").splitlines():
        match = re.match(r"\s+([a-z_][a-z0-9_]*(?:, [a-z_][a-z0-9_]*)*): (.+)", line)
        if match is None:
            continue
        for name in match.group(1).split(", "):
            found.setdefault(name, match.group(2).strip())
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    except (OSError, TypeError):  # no source (defined interactively)
        return found
    statements = body.body if isinstance(body, ast.ClassDef) else []
    for field, text in itertools.pairwise(statements):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(text, ast.Expr)
            and isinstance(text.value, ast.Constant)
            and isinstance(text.value.value, str)
        ):
            words = " ".join(text.value.value.split())
            found.setdefault(field.target.id, re.split(r"(?<=\.)\s+(?=[A-Z`])", words, maxsplit=1)[0])
    return found


def flag_name(field: str, names: Mapping[str, str]) -> str:
    """The flag of ``field``: ``names[field]`` when given, else the field name in kebab case."""
    return "--" + names.get(field, field.replace("_", "-"))


def add_settings_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    names: Mapping[str, str] | None = None,
    choices: Mapping[str, Sequence[str]] | None = None,
    exclude: Sequence[str] = (),
) -> None:
    """Register a flag for every field of dataclass ``cls`` except ``exclude``.

    ``names`` renames flags (field -> flag without ``--``); ``choices`` restricts a string field to given values.
    Every flag stores into ``cls.__name__ + "." + field`` so that several dataclasses share one parser safely.
    """
    names = names or {}
    choices = choices or {}
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    for field in dataclasses.fields(cls):
        if field.name in exclude or not field.init:
            continue
        if field.default is dataclasses.MISSING:
            raise ArgumentTypeError(f"{cls.__name__}.{field.name} has no default: settings need one default per field")
        kind, optional = _flag_type(hints[field.name])
        default = field.default
        options: dict[str, Any] = {"dest": f"{cls.__name__}.{field.name}", "default": default}
        if kind is not bool:
            options["metavar"] = field.name.upper()
        text = helps.get(field.name, field.name.replace("_", " "))
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            options["type"] = kind
            options["choices"] = list(kind)
            options["metavar"] = "{" + ",".join(str(member.value) for member in kind) + "}"
            options["default"] = kind(default) if default is not None else None
        else:
            options["type"] = kind
            if field.name in choices:
                options["choices"] = list(choices[field.name])
        default_text = "none" if default is None else getattr(default, "value", default)
        if isinstance(default, tuple):
            default_text = ",".join(map(str, default)) or "none"
        options["help"] = f"{text} (default: {default_text})" if optional or default is not None else text
        parser.add_argument(flag_name(field.name, names), **options)


def settings_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed values of ``cls``'s flags registered by :func:`add_settings_arguments`, by field name."""
    return {
        field.name: getattr(args, f"{cls.__name__}.{field.name}")
        for field in dataclasses.fields(cls)
        if hasattr(args, f"{cls.__name__}.{field.name}")
    }


def settings_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """``cls`` built from the flags :func:`add_settings_arguments` registered; ``overrides`` set excluded fields."""
    return cls(**settings_values(cls, args), **overrides)
