"""The package's structure: the public surface, no import cycles, no import from a lower layer to a higher one.

The layers and the import reading are those of :mod:`kvboost_hf.tools.import_graph` (``python -m
kvboost_hf.tools.import_graph`` prints the whole report).
"""

import os
import subprocess
import sys
from pathlib import Path

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
        import_graph.layer_of(module)  # raises KeyError for a module the layer table does not place


def test_no_import_cycle_between_modules() -> None:
    """No cycle, counting executed imports (module level and inside functions) and TYPE_CHECKING imports alike."""
    modules, edges = _edges()
    assert import_graph.strongly_connected(modules, {(edge.source, edge.target) for edge in edges}) == []


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
    assert kvboost_hf.SamplingConfig is kvboost_hf.SamplingConfig
    assert kvboost_hf.DraftConfig is kvboost_hf.DraftConfig
    assert kvboost_hf.LayerStreamingConfig is kvboost_hf.LayerStreamingConfig


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
            assert record or not callable(value), f"server imports {module}.{name}, which is behaviour"
