"""The package's structure: the public surface, no import cycles, no import from a lower layer to a higher one.

The layers and the import reading are those of :mod:`kvboost_hf.tools.import_graph` (``python -m
kvboost_hf.tools.import_graph`` prints the whole report).
"""

import ast
import dataclasses
import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kvboost_hf
from kvboost_hf.tools import import_graph

ROOT = Path(__file__).resolve().parents[1]

#: Upward imports that remain, as (source module, target module): each with the reason it stays.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

USER_SURFACE = {
    "ChunkReuseCache",
    "ChunkStore",
    "ChunkWriteBack",
    "ChunkingConfig",
    "CorrectnessReport",
    "DocumentBoundaries",
    "DraftConfig",
    "GenerationMode",
    "GenerationResult",
    "InferenceEngine",
    "KVBoost",
    "KVBoostError",
    "LayerStreamingConfig",
    "RecomputeStrategy",
    "RepairConfig",
    "SamplingConfig",
    "Speculation",
    "StoreConfig",
    "UnsupportedModelError",
    "WarmResult",
    "disable_layer_streaming",
    "enable_layer_streaming",
    "uninstall_hooks",
    "without_hooks",
}


def test_package_exports_the_user_surface_only() -> None:
    assert set(kvboost_hf.__all__) == USER_SURFACE
    for name in USER_SURFACE:
        assert getattr(kvboost_hf, name) is not None
    for internal in ("DecodeLoop", "DecodeRequest", "BatchPolicy", "plan_reuse", "ReusePlan", "ChunkKV"):
        assert not hasattr(kvboost_hf, internal), internal


REGISTERED = """
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
assert "kvboost" in AttentionInterface._global_mapping and "kvboost" in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
from transformers import GenerationMixin
assert getattr(GenerationMixin.generate, "_kvboost_dispatch", False), "generate() does not reach the adapter"
"""
#: Fresh interpreters importing the package and transformers' model code in each order a program can.
IMPORT_ORDERS = {
    # the package alone loads no model code (nor prints anything); the model code, loaded later (here as by
    # ``from kvboost_hf import KVBoost``, whose engine module imports it), finds "kvboost"
    "package_first": """
import sys
import kvboost_hf
import kvboost_hf.store.disk, kvboost_hf.server.grammar_child
assert "transformers.modeling_utils" not in sys.modules, "import kvboost_hf loaded transformers' model code"
from transformers import AutoModelForCausalLM
""",
    # (transformers logs torchao's import-time lines here before the package is imported: not checked)
    "transformers_first": "import transformers.modeling_utils\nimport kvboost_hf\n",
    # the attention module's own import loads the model code, which then imports it (half-imported) again
    "attention_module_first": "import kvboost_hf.hf.attention\n",
}


def test_every_import_order_registers_the_attention_and_prints_nothing() -> None:
    """``import kvboost_hf`` registers ``attn_implementation="kvboost"`` (docs: "registered on import") whether
    transformers' model code was loaded before it, is loaded after it, or is loaded by the package itself; the
    package alone loads none of that code, and the package prints nothing (torchao's import-time logs are quieted)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    children = {
        order: subprocess.Popen(
            [sys.executable, "-c", code + REGISTERED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, cwd=ROOT,
        )
        for order, code in IMPORT_ORDERS.items()
    }  # fmt: skip
    for order, child in children.items():
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, (order, err[-2000:])
        assert order == "transformers_first" or (out, err) == ("", ""), (order, out, err)


def _edges() -> tuple[dict[str, Path], list[import_graph.ImportEdge]]:
    modules = import_graph.discover_modules(ROOT)
    return modules, import_graph.import_edges(modules)


def test_every_module_has_a_layer() -> None:
    modules, _ = _edges()
    assert len(modules) > 50
    for module in modules:
        import_graph.layer_of(module)  # raises NotFoundError for a module the layer table does not place


def test_no_import_cycle_between_modules() -> None:
    """No cycle, counting executed imports (module level and inside functions) and TYPE_CHECKING imports alike."""
    modules, edges = _edges()
    assert import_graph.strongly_connected(modules, {(edge.source, edge.target) for edge in edges}) == []


def test_no_test_module_imports_another() -> None:
    """Code that several test modules share lives in tests/'s other modules (conftest, helpers, chunks, ...): a test
    module importing another runs that module's imports and assertion rewriting wherever it is imported."""
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            assert not [name for name in names if name.split(".")[0].startswith("test_")], (path.name, names)


def test_no_import_cycle_between_subpackages() -> None:
    modules, edges = _edges()
    groups = {import_graph.subpackage_of(module) for module in modules}
    pairs = {
        (import_graph.subpackage_of(edge.source), import_graph.subpackage_of(edge.target))
        for edge in edges
        if import_graph.subpackage_of(edge.source) != import_graph.subpackage_of(edge.target)
    }
    assert import_graph.strongly_connected(groups, pairs) == []


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    _, edges = _edges()
    upward = {(edge.source, edge.target) for edge in import_graph.upward_edges(edges)}
    assert upward - ALLOWED_UPWARD.keys() == set()
    assert ALLOWED_UPWARD.keys() - upward == set(), "an allowed upward import is gone: drop it from the list"


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    """The detectors on a made-up graph: a two-module cycle is found, a core -> server import is upward."""
    assert import_graph.strongly_connected(["a", "b", "c"], [("a", "b"), ("b", "a"), ("b", "c")]) == [["a", "b"]]
    edge = import_graph.ImportEdge("kvboost_hf.core.keys", "kvboost_hf.server.app", 1, "lazy")
    assert import_graph.upward_edges([edge]) == [edge]
    assert import_graph.upward_edges([import_graph.ImportEdge(edge.source, edge.target, 1, "typing")]) == []


def test_settings_classes_share_one_suffix_and_old_readme_names_are_the_same_classes():
    from kvboost_hf.server.grammar import GrammarConfig
    from kvboost_hf.server.launch import SETTINGS_FLAGS
    from kvboost_hf.server.settings import ServerConfig

    settings_classes = {cls for cls, _, _ in SETTINGS_FLAGS} | {ServerConfig, GrammarConfig, kvboost_hf.SamplingConfig}
    assert len(settings_classes) >= 8
    assert sorted(cls.__name__ for cls in settings_classes if not cls.__name__.endswith("Config")) == []
    assert kvboost_hf.SamplingParams is kvboost_hf.SamplingConfig
    assert kvboost_hf.DraftSettings is kvboost_hf.DraftConfig
    assert kvboost_hf.LayerStreaming is kvboost_hf.LayerStreamingConfig


def test_request_objects_take_keywords_only():
    import dataclasses

    from kvboost_hf.hf.decode import DecodeRequest
    from kvboost_hf.serve_ray.routing import ForwardedRequest
    from kvboost_hf.server.batching import JobParams

    for request in (DecodeRequest, JobParams, ForwardedRequest):
        assert all(field.kw_only for field in dataclasses.fields(request)), request.__name__


def test_architecture_doc_lists_the_exports_as_they_are():
    """docs/ARCHITECTURE.md's table of public objects: every exported name appears, and its last column says
    whether each listed name is in ``kvboost_hf.__all__`` (yes / no / only ...)."""
    import re
    from pathlib import Path

    import kvboost_hf

    exported = set(kvboost_hf.__all__)
    text = (Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| (.+?) \| .+? \| (yes|no|only .+?|registered on import) \|$", text, re.MULTILINE)
    listed: set[str] = set()
    for names_cell, column in rows:
        names = re.findall(r"`([A-Za-z_]+)`", names_cell)
        listed |= set(names)
        inside = [name for name in names if name in exported]
        if column == "registered on import":
            continue
        expected = (
            "yes"
            if len(inside) == len(names)
            else "no"
            if not inside
            else "only " + ", ".join(f"`{name}`" for name in inside)
        )
        assert column == expected, names_cell
    assert exported - listed - {"__version__"} == set(), "exported names missing from docs/ARCHITECTURE.md"


def test_names_the_docs_place_in_a_source_file_are_defined_there() -> None:
    """Each "`name` in `kvboost_hf/path.py`" of README.md and docs/*.md names a function, class or variable
    defined in that file (docs/server.md named `rank` where the function is `choose_ranked`)."""
    import re

    placed = re.compile(r"`([A-Za-z_]\w*)[\w.]*(?:\(\))?` in `(kvboost_hf/[\w/]+\.py)`")
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name, path in placed.findall(" ".join(doc.read_text().split())):
            tree = ast.parse((ROOT / path).read_text())
            defined = {
                node.name
                for node in ast.walk(tree)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            } | {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
            found.append((doc.name, name, path, name in defined))
    assert len(found) >= 3 and [entry for entry in found if not entry[-1]] == []


def test_the_server_takes_only_types_and_constants_from_hf() -> None:
    """The engine and its scheduler are the server's only entry into the library: what server modules import from
    ``kvboost_hf.hf`` are records, enums and constants (requests, rows, settings), never a function or a class that
    runs the model (a decode loop, a cache, a drafter)."""
    import ast
    import dataclasses
    import enum
    import importlib

    taken: dict[str, set[str]] = {}
    for path in (ROOT / "kvboost_hf" / "server").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvboost_hf.hf"):
                taken.setdefault(node.module or "", set()).update(alias.name for alias in node.names)
    assert taken, "the server imports some types from hf"
    for module, names in taken.items():
        for name in names:
            value = getattr(importlib.import_module(module), name)
            record = isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
            allowed = f"{module}.{name}" in SERVER_TAKES_FROM_HF
            assert record or allowed or not callable(value), f"server imports {module}.{name}, which is behaviour"


#: Behaviour the server may take from ``hf`` all the same, each with the reason (none of it runs the model).
SERVER_TAKES_FROM_HF = {
    "kvboost_hf.hf.detokenize.IncrementalText": "text bookkeeping of generated ids (the tool-call processor's text)",
}


#: Parameters that carry a settings field under another name: parameter -> the field it stands for.
SETTINGS_FIELD_ALIASES = {
    "max_rows": "max_batch_size",
    "grace_s": "shutdown_grace_s",
    "read_timeout_s": "remote_read_timeout_s",
}

#: Defaults that share a settings field's name and value but not its meaning: (module, name) -> why.
UNRELATED_DEFAULTS = {
    ("kvboost_hf.tools.awq_load", "device"): "where a checkpoint loads, not StoreConfig.device (the RAM tier's)",
    ("kvboost_hf.tools.awq_pack", "device"): "where random int4 layers are built, not StoreConfig.device",
}


def _comparable(value: object) -> tuple[str, object] | None:
    """A number, string or bool as a key that tells ``True`` from ``1`` and equates ``8`` with ``8.0``; None for
    anything else (None itself, containers, objects)."""
    if isinstance(value, (bool, str)):
        return type(value).__name__, value
    if isinstance(value, (int, float)):
        return "number", float(value)
    return None


def _literal(node: ast.expr) -> tuple[str, object] | None:
    """The comparable value of ``node`` when it is written with constants and operators only (``8``, ``2 << 30``,
    ``"fixed"``); None for a name, a call or a container."""
    allowed = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)
    if not all(isinstance(part, allowed) for part in ast.walk(node)):
        return None
    return _comparable(eval(compile(ast.Expression(node), "<default>", "eval")))


def _settings_class_names(tree: ast.Module) -> list[str]:
    """Top-level ``@dataclass`` classes named ``*Config``: the settings classes."""

    def is_dataclass(decorator: ast.expr) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return isinstance(target, ast.Name) and target.id == "dataclass"

    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and node.name.endswith("Config")
        and any(map(is_dataclass, node.decorator_list))
    ]


def literal_defaults(source: str) -> list[tuple[str, tuple[str, object], int]]:
    """``(name, value, line)`` of each literal default in ``source`` outside settings classes: parameters of
    functions, annotated fields and attributes of other classes."""
    tree = ast.parse(source)
    settings = set(_settings_class_names(tree))
    found: list[tuple[str, tuple[str, object], int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name not in settings:
            for statement in node.body:
                if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                    continue
                if statement.value is not None and (value := _literal(statement.value)) is not None:
                    found.append((statement.target.id, value, statement.lineno))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            positional = arguments.posonlyargs + arguments.args
            defaulted = positional[len(positional) - len(arguments.defaults) :]
            pairs = [
                *zip(defaulted, arguments.defaults, strict=True),
                *zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True),
            ]
            for argument, default in pairs:
                if default is not None and (value := _literal(default)) is not None:
                    found.append((argument.arg, value, argument.lineno))
    return found


def repeated_defaults(settings: dict[str, list[tuple[str, Any]]], sources: dict[str, str]) -> list[str]:
    """``"module:line name=value repeats Class.field"`` for each literal default in ``sources`` (module -> text)
    equal to the default of a settings field (``settings``: field name -> ``[("Class.field", default)]``) of its
    name or of the field :data:`SETTINGS_FIELD_ALIASES` gives it, unless :data:`UNRELATED_DEFAULTS` names it."""
    found = []
    for module, source in sources.items():
        for name, value, line in literal_defaults(source):
            for owner, default in settings.get(SETTINGS_FIELD_ALIASES.get(name, name), []):
                if _comparable(default) == value and (module, name) not in UNRELATED_DEFAULTS:
                    found.append(f"{module}:{line} {name}={value[1]!r} repeats {owner}")
    return sorted(found)


def test_settings_defaults_are_written_once() -> None:
    """A settings field's default is written in its class only: elsewhere the package refers to it (the class
    attribute, or the constant the field itself takes) instead of repeating the literal, so the two never drift."""
    modules, _ = _edges()
    sources = {module: path.read_text() for module, path in modules.items()}
    settings: dict[str, list[tuple[str, Any]]] = {}
    for module, source in sources.items():
        for name in _settings_class_names(ast.parse(source)) if not module.startswith("kvboost_hf.bench") else []:
            for field in dataclasses.fields(getattr(importlib.import_module(module), name)):
                if field.default is not dataclasses.MISSING:
                    settings.setdefault(field.name, []).append((f"{name}.{field.name}", field.default))
    assert {"max_batch_size", "shutdown_grace_s", "remote_read_timeout_s", "num_slots"} <= settings.keys()
    assert repeated_defaults(settings, sources) == []


def test_the_defaults_check_sees_a_repeated_default() -> None:
    settings = {
        "max_batch_size": [("ServerConfig.max_batch_size", 8)],
        "max_bytes": [("StoreConfig.max_bytes", 1 << 30)],
    }
    source = """
@dataclass(frozen=True)
class OtherConfig:
    max_batch_size: int = 8

class Runner:
    max_bytes: int = 2 << 29

def generate_many(prompts, max_batch_size=8, *, max_rows: float = 8.0, limit=8):
    pass

def unrelated(max_batch_size=True, max_bytes=None):
    pass
"""
    assert repeated_defaults(settings, {"m": source}) == [
        "m:7 max_bytes=1073741824.0 repeats StoreConfig.max_bytes",
        "m:9 max_batch_size=8.0 repeats ServerConfig.max_batch_size",
        "m:9 max_rows=8.0 repeats ServerConfig.max_batch_size",
    ]
