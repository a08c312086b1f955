"""Settings dataclasses as command-line flags: every field has a generated flag, parsing none gives the
dataclasses' defaults, and the engine takes settings objects (old keywords and double sampling are clear errors)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
from dataclasses import dataclass

import pytest
from conftest import make_tiny_model
from helpers import word_tokenizer

from kvboost_hf import KVBoost
from kvboost_hf.core.config import GenerationMode, RecomputeStrategy, RepairConfig
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.core.settings import add_settings_arguments, settings_from_args, settings_values
from kvboost_hf.engine import GenerateOptions, sampling_params
from kvboost_hf.hf.graphs import GraphConfig
from kvboost_hf.hf.sampling import SamplingConfig
from kvboost_hf.hf.speculative import DraftConfig
from kvboost_hf.server.launch import SETTINGS_FLAGS, add_arguments, check_settings
from kvboost_hf.server.settings import ServerConfig
from kvboost_hf.store.config import StoreConfig


def server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


@pytest.mark.parametrize("cls, options", [(cls, options) for cls, _, options in SETTINGS_FLAGS], ids=lambda v: "")
def test_every_settings_field_has_a_flag_and_parsing_none_gives_the_dataclass_defaults(cls, options):
    parser = server_parser()
    flags = {option for action in parser._actions for option in action.option_strings}
    excluded = set(options.get("exclude", ()))
    values = settings_values(cls, parser.parse_args([]))
    for field in dataclasses.fields(cls):
        if field.name in excluded:
            assert field.name not in values
            continue
        flag = "--" + options.get("names", {}).get(field.name, field.name.replace("_", "-"))
        assert flag in flags, f"{cls.__name__}.{field.name} has no flag {flag}"
        expected = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
        assert values[field.name] == expected, f"{flag} defaults to {values[field.name]!r}, the field to {expected!r}"


def test_server_settings_and_store_config_from_no_flags_equal_their_defaults():
    args = server_parser().parse_args([])
    assert settings_from_args(ServerConfig, args, model_name=ServerConfig().model_name) == ServerConfig()
    assert settings_from_args(StoreConfig, args) == StoreConfig()
    assert settings_from_args(RepairConfig, args) == RepairConfig()


def test_flags_parse_into_the_settings():
    args = server_parser().parse_args(
        ["--recompute-strategy", "cacheblend", "--sink-tokens", "4", "--max-cache-bytes", "1000", "--batch-window-ms",
         "2.5", "--no-stream-pin-memory", "--draft-early-exit", "2", "--reuse-mode", "chunk"]
    )  # fmt: skip
    repair = settings_from_args(RepairConfig, args)
    assert (repair.strategy, repair.sink_tokens) == (RecomputeStrategy.CACHEBLEND, 4)
    assert settings_from_args(StoreConfig, args).max_bytes == 1000
    server = settings_from_args(ServerConfig, args)
    assert (server.batch_window_ms, server.reuse_mode) == (
        2.5,
        "chunk_kv_reuse",
    )  # the former spelling, stored as the mode
    assert settings_values(SETTINGS_FLAGS[4][0], args)["pin_memory"] is False


def test_reuse_mode_choices_are_the_generation_modes_and_their_former_spellings():
    parser = server_parser()
    action = next(a for a in parser._actions if "--reuse-mode" in a.option_strings)
    assert list(action.choices) == ["baseline", "prefix_cache", "chunk_kv_reuse", "off", "prefix", "chunk"]
    for flag, mode in [
        ("off", "baseline"),
        ("prefix", "prefix_cache"),
        ("chunk", "chunk_kv_reuse"),
        ("baseline", "baseline"),
    ]:
        assert settings_from_args(ServerConfig, parser.parse_args(["--reuse-mode", flag])).reuse_mode == mode
    assert GenerationMode("prefix") is GenerationMode.PREFIX_CACHE and ServerConfig().reuse_mode == "prefix_cache"
    with pytest.raises(SystemExit):
        parser.parse_args(["--reuse-mode", "everything"])


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Example:
    """Example settings.

    Attributes:
        size, other: tokens per thing.
    """

    size: int = 3
    colour: Colour = Colour.RED
    enabled: bool = False
    limit: float | None = None


def test_generated_flags_follow_the_annotations_and_docstring():
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, Example, names={"limit": "cap"})
    assert settings_from_args(Example, parser.parse_args([])) == Example()
    parsed = settings_from_args(
        Example, parser.parse_args(["--size", "7", "--colour", "blue", "--enabled", "--cap", "1.5"])
    )
    assert parsed == Example(7, Colour.BLUE, True, 1.5)
    assert settings_from_args(Example, parser.parse_args(["--no-enabled"])).enabled is False
    size = next(a for a in parser._actions if "--size" in a.option_strings)
    assert size.help == "tokens per thing. (default: 3)"
    with pytest.raises(SystemExit):
        parser.parse_args(["--colour", "green"])


def test_a_field_without_default_or_flag_type_is_refused():
    @dataclass(frozen=True)
    class NoDefault:
        size: int

    @dataclass(frozen=True)
    class Odd:
        ids: frozenset[int] = frozenset()

    with pytest.raises(TypeError, match="no default"):
        add_settings_arguments(argparse.ArgumentParser(), NoDefault)
    with pytest.raises(TypeError, match="no command-line flag"):
        add_settings_arguments(argparse.ArgumentParser(), Odd)


def test_sampling_shorthands_build_one_params_and_both_is_an_error():
    assert sampling_params(None) == SamplingConfig(temperature=0.0)
    assert sampling_params(None, temperature=0.5, do_sample=True, top_p=0.9, seed=3) == SamplingConfig(
        temperature=0.5, top_p=0.9, seed=3
    )
    given = SamplingConfig(temperature=0.7, top_k=4)
    assert sampling_params(given) is given
    with pytest.raises(ValueError, match="temperature"):
        sampling_params(given, temperature=0.2)
    with pytest.raises(ValueError, match="seed"):
        sampling_params(given, seed=1)


def test_generate_options_resolve_sampling_once_and_build_one_request_per_prompt():
    """The options the three generate entry points share: the shorthands become the rows' sampling settings (a
    conflict is refused before any prompt is read), a single stop string is one stop, ``logprobs`` keeps the first
    token's logits."""
    options = GenerateOptions(max_new_tokens=5, temperature=0.5, do_sample=True, seed=3, stop="END", logprobs=2)
    assert options.decoding == SamplingConfig(temperature=0.5, top_p=1.0, seed=3)
    first, second = options.requests([([7, 8, 9], []), ([4, 5], [0, 1])])
    assert (first.prompt_ids, first.segment_starts, second.prompt_ids, second.segment_starts) == (
        [7, 8, 9], (), [4, 5], (0, 1)
    )  # fmt: skip
    assert first.max_new_tokens == 5 and first.stop == ("END",) and first.sampling == options.decoding
    assert first.top_logprobs == 2 and first.keep_first_logits
    assert GenerateOptions(stop=["a", "b"]).requests([([1], [])])[0].stop == ("a", "b")
    assert not GenerateOptions().requests([([1], [])])[0].keep_first_logits
    with pytest.raises(ValueError, match="top_p"):
        GenerateOptions(sampling=SamplingConfig(), top_p=0.9)


def test_engine_takes_settings_objects_and_names_an_old_keyword(embedded_engine):
    model, tokenizer = embedded_engine.model, embedded_engine.tokenizer
    repair = RepairConfig("cacheblend", 0.3, sink_tokens=2)
    config = StoreConfig(max_bytes=1 << 20, kv_cache_bits=8)
    engine = KVBoost(model, tokenizer, repair=repair, store=config)
    assert engine.repair is repair and engine.store.config == config
    with pytest.raises(TypeError, match="recompute_strategy"):
        KVBoost(model, tokenizer, recompute_strategy="none")
    with pytest.raises(ValueError, match="not both"):
        engine.generate("Hi", max_new_tokens=1, temperature=0.5, sampling=SamplingConfig())


def test_from_pretrained_passes_settings_objects(monkeypatch, embedded_engine):
    import kvboost_hf.engine as engine_module

    monkeypatch.setattr(
        engine_module, "load_model_and_tokenizer", lambda *a, **k: (embedded_engine.model, embedded_engine.tokenizer)
    )
    repair = RepairConfig(ratio=0.5)
    engine = KVBoost.from_pretrained(None, repair=repair, store=StoreConfig(max_bytes=1 << 20), chunking=32)
    assert (engine.repair, engine.store.config.max_bytes, engine.chunking.chunk_size) == (repair, 1 << 20, 32)
    with pytest.raises(TypeError, match="recompute_ratio"):
        KVBoost.from_pretrained(None, recompute_ratio=0.5)


def test_draft_tree_flags_reach_the_engine(tmp_path):
    """Every generated draft flag reaches the engine's draft settings (the tree budget included)."""
    from conftest import make_tiny_model
    from helpers import word_tokenizer

    from kvboost_hf.hf.speculative import DraftConfig
    from kvboost_hf.server.launch import add_arguments, build_engine

    make_tiny_model("llama").save_pretrained(tmp_path / "target")
    word_tokenizer().save_pretrained(tmp_path / "target")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--model", str(tmp_path / "target"), "--draft-early-exit", "1", "--num-draft-tokens", "4",
             "--tree-budget", "12", "--tree-branching", "3"]  # fmt: skip
    engine = build_engine(parser.parse_args(flags))
    expected = DraftConfig(num_draft_tokens=4, early_exit_layers=1, tree_budget=12, tree_branching=3)
    assert engine.draft_settings == expected and engine.speculative


def test_graph_and_attention_flags_reach_the_engine(tmp_path):
    """Graphs follow the device unless --graphs / --no-graphs says (off on this CPU); the generated graph flags
    (comma-separated buckets) reach the engine's GraphConfig; --attn-implementation picks the model's attention
    (default: the package's for the device, "kvboost" on the CPU)."""
    from conftest import make_tiny_model
    from helpers import word_tokenizer

    from kvboost_hf.hf.graphs import GraphConfig
    from kvboost_hf.server.launch import build_engine

    make_tiny_model("llama").save_pretrained(tmp_path / "target")
    word_tokenizer().save_pretrained(tmp_path / "target")
    model = ["--model", str(tmp_path / "target")]
    plain = build_engine(server_parser().parse_args(model))
    assert plain.graphs.config == GraphConfig(enabled=False) and plain.model.config._attn_implementation == "kvboost"
    flags = ["--graphs", "--graph-row-buckets", "1,4", "--graph-query-buckets", "", "--max-graphs", "3",
             "--graph-max-capture-bytes", "1000", "--attn-implementation", "sdpa"]  # fmt: skip
    engine = build_engine(server_parser().parse_args(model + flags))
    expected = GraphConfig(row_buckets=(1, 4), query_buckets=(), max_graphs=3, max_capture_bytes=1000)
    assert engine.graphs.config == expected and engine.model.config._attn_implementation == "sdpa"
    with pytest.raises(SystemExit):
        server_parser().parse_args(["--graph-row-buckets", "1,x"])


def test_a_field_documented_after_its_declaration_gets_that_first_sentence_as_help():
    @dataclass(frozen=True)
    class Documented:
        """Settings."""

        buckets: tuple[int, ...] = (1, 2)
        """Sizes, ascending; e.g. 1,2 or 4. Padded up to the next one."""

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, Documented)
    action = next(a for a in parser._actions if "--buckets" in a.option_strings)
    assert action.help == "Sizes, ascending; e.g. 1,2 or 4. (default: 1,2)"
    assert settings_from_args(Documented, parser.parse_args(["--buckets", "3,5"])) == Documented((3, 5))


class _CoreEngine:
    """The one engine call a Worker makes before it starts: an engine core for the server's mode and settings."""

    def core(self, mode: object, **settings: object) -> tuple[object, dict[str, object]]:
        return mode, {key: value for key, value in settings.items() if key != "tokenizer_lock"}


def test_worker_takes_the_server_settings_in_their_units():
    """The worker has no defaults of its own: it hands ServerConfig's fields (the batch window in ms) and its mode to
    the engine's core."""
    from kvboost_hf.server.worker import Worker

    worker = Worker(
        _CoreEngine(),
        ServerConfig(
            reuse_mode="chunk_kv_reuse",
            batch_window_ms=250,
            max_batch_size=3,
            token_budget=96,
            kv_budget_bytes=4096,
            pack_forwards=False,
        ),
    )  # type: ignore[arg-type]
    assert worker.max_batch_size == 3 and worker.max_queue == 64 and worker.mode is GenerationMode.CHUNK_KV_REUSE
    given = {
        "max_batch_size": 3,
        "token_budget": 96,
        "kv_budget_bytes": 4096,
        "batch_window_ms": 250,
        "pack_forwards": False,
    }
    assert worker.core == (worker.mode, given)
    default = Worker(_CoreEngine())  # type: ignore[arg-type]
    settings = ServerConfig()
    expected = {
        "max_batch_size": settings.max_batch_size,
        "token_budget": settings.token_budget,
        "kv_budget_bytes": settings.kv_budget_bytes,
        "batch_window_ms": settings.batch_window_ms,
        "pack_forwards": settings.pack_forwards,
    }
    assert default.core == (GenerationMode.PREFIX_CACHE, expected)


@pytest.mark.parametrize(
    "field, value",
    [
        ("reuse_mode", "sometimes"),
        ("max_batch_size", 0),
        ("max_queue", 0),
        ("batch_window_ms", -1),
        ("token_budget", -1),
        ("token_budget", 3),
        ("kv_budget_bytes", -1),
    ],
)
def test_server_settings_refuse_values_the_worker_cannot_run(field, value):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: value})


def test_freeze_startup_heap_exempts_the_live_objects_from_later_collections() -> None:
    """The serving process's startup objects leave the collector's reach: a full collection afterwards scans none of
    them (what ``serve`` and each Ray replica call once the model is loaded)."""
    import gc

    from kvboost_hf.server.launch import freeze_startup_heap

    survivor = [[index] for index in range(1000)]  # live, tracked containers
    gc.collect()  # survivors of a collection reach the oldest generation
    assert any(each is survivor for each in gc.get_objects(generation=2))
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= len(survivor)
        assert not any(each is survivor for each in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--chunk-size", "0"], "chunk_size must be a positive"),
        (["--port", "70000"], "--port must be in"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--header-timeout-s", "0"], "header_timeout_s must be a number > 0"),
        (["--body-timeout-s", "-1"], "body_timeout_s must be a number > 0"),
        (["--max-tokens-limit", "-1"], "max_tokens_limit must be a number >= 1"),
        (["--shutdown-grace-s", "nan"], "shutdown_grace_s must be a number >= 0"),
        (["--grammar-workers", "0"], "workers must be a number >= 1"),
        (["--token-budget", "3"], "token_budget"),
        (["--recompute-ratio", "nan"], "ratio"),
        (["--num-draft-tokens", "0"], "num_draft_tokens"),
        (["--graph-row-buckets", "2,1"], "row_buckets"),
        (["--stream-num-slots", "0"], "num_slots"),
        (["--kv-budget-bytes", "-1"], "kv_budget_bytes"),
        (["--max-cache-bytes", "-1"], "max_bytes"),
    ],
)
def test_a_bad_server_flag_is_refused_before_the_model_loads(flags, message):
    """Every settings object the flags describe is built without a model (a bad value was a traceback after the
    model loaded, or was accepted and broke every request: a 408 for every POST with --body-timeout-s -1)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match=message):
        check_settings(parser.parse_args(flags))


def test_a_warm_flag_naming_no_readable_file_exits_2_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """``--warm`` missing or a directory was a FileNotFoundError / IsADirectoryError after the model loaded."""
    from kvboost_hf.server import launch

    monkeypatch.setattr(launch, "build_app", lambda args: pytest.fail("the model was loaded"))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for warm, found in ((tmp_path / "missing.txt", "not found"), (tmp_path, "a directory")):
        assert launch.serve(parser.parse_args(["--warm", str(warm)])) == 2
        assert f"--warm must name a readable text file, got {warm} ({found})" in capsys.readouterr().err
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))  # not UTF-8: it failed after the model loaded
    assert launch.serve(parser.parse_args(["--warm", str(latin1)])) == 2
    assert f"--warm must name a UTF-8 text file, got {latin1}" in capsys.readouterr().err
    (tmp_path / "docs.txt").write_text("a document")
    check_settings(parser.parse_args(["--warm", str(tmp_path / "docs.txt")]))


def test_the_default_server_flags_pass_the_check():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    check_settings(parser.parse_args([]))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: GraphConfig(enabled="no"), "enabled must be True or False"),
        (lambda: GraphConfig(row_buckets=(1.5,)), "must hold integers"),
        (lambda: GraphConfig(max_graphs=1.5), "must be integers"),
        (lambda: DraftConfig(num_draft_tokens=True), "num_draft_tokens"),
        (lambda: DraftConfig(early_exit_layers=True), "early_exit_layers"),
        (lambda: DraftConfig(tree_budget=4, adaptive_tree_budget="yes"), "adaptive_tree_budget must be True or False"),
        (lambda: DraftConfig(confidence_threshold="x"), "confidence_threshold"),
        (lambda: DraftConfig(tree_overhead="1"), "tree_overhead"),
        (lambda: ServerConfig(kv_budget_bytes="1GB"), "kv_budget_bytes must be None"),
    ],
)
def test_settings_of_the_wrong_type_are_refused_by_name(make, message):
    """A string "no" counted as true and a bool as 1; a string raised TypeError."""
    with pytest.raises(ConfigError, match=message):
        make()


@pytest.mark.parametrize("argument", ["graphs", "token_cache", "draft", "repair"])
def test_the_engine_refuses_a_settings_argument_of_another_type(argument):
    """``graphs=True`` was taken, then failed inside generate with an AttributeError."""
    with pytest.raises(ConfigError, match=f"{argument} must be a"):
        KVBoost(make_tiny_model("llama"), word_tokenizer(), **{argument: True})
