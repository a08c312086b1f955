"""The embedded model's conversion into the user cache: two processes converting at once convert it once and
leave no temporary folder; a conversion that failed or was killed leaves nothing that outlives the next one.
The GGUF loading is replaced by small fakes (the real conversion takes 10-20 s); the locking code is the real one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from forkserver import ForkedProcess
from helpers import ENV, python_child

from kvboost_hf.hf import models

_FAKES = textwrap.dedent(
    """
    import os, time
    from pathlib import Path

    class FakeModel:
        hf_quantizer = None

        def __init__(self, log: Path, save_s: float, fail: bool) -> None:
            self.config, self.log, self.save_s, self.fail = type("Config", (), {})(), log, save_s, fail

        def save_pretrained(self, path) -> None:
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / "config.json").write_text("{}")
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()}\\n")
            time.sleep(self.save_s)
            if self.fail:
                raise OSError("no space left (fake)")
            (Path(path) / "model.safetensors").write_bytes(b"w" * 1000)

    class FakeTokenizer:
        def save_pretrained(self, path) -> None:
            (Path(path) / "tokenizer.json").write_text("{}")

    def fakes(gguf: Path, log: Path, save_s: float = 0.0, fail: bool = False) -> dict:
        # replacements for attributes of kvboost_hf.hf.models
        return {
            "embedded_gguf_path": lambda: gguf,
            "AutoModelForCausalLM": type(
                "FakeAuto", (), {"from_pretrained": staticmethod(lambda *a, **k: FakeModel(log, save_s, fail))}
            ),
            "AutoTokenizer": type("FakeTok", (), {"from_pretrained": staticmethod(lambda *a, **k: FakeTokenizer())}),
        }
    """
)

_CONVERTER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from kvboost_hf.hf import models
    fakes = {}
    exec(sys.argv[1], fakes)
    work, save_s, peers = Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    for name, fake in fakes["fakes"](work / "model.gguf", work / "conversions.log", save_s).items():
        setattr(models, name, fake)
    (work / f"ready-{sys.argv[5]}").touch()
    while len(list(work.glob("ready-*"))) < peers:  # start converting together
        time.sleep(0.01)
    print("converting", flush=True)
    print(models.embedded_model_dir(), flush=True)
    """
)


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setenv("KVBOOST_HF_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _target(work: Path) -> Path:
    return work / "cache" / "model-64"


def _leftovers(work: Path) -> list[str]:
    return sorted(p.name for p in (work / "cache").iterdir() if ".tmp" in p.name)


def _converter(work: Path, save_s: float, peers: int, name: str) -> ForkedProcess:
    """A process converting the fake model into ``work``'s cache (the variable is read when it converts)."""
    return python_child(
        _CONVERTER, _FAKES, work, save_s, peers, name, env={**ENV, "KVBOOST_HF_CACHE": str(work / "cache")}
    )


def _install_fakes(monkeypatch: pytest.MonkeyPatch, work: Path, fail: bool = False) -> None:
    fakes: dict = {}
    exec(_FAKES, fakes)
    for name, fake in fakes["fakes"](work / "model.gguf", work / "conversions.log", fail=fail).items():
        monkeypatch.setattr(models, name, fake)


def test_two_processes_converting_at_once_convert_once_and_leave_no_temporary_folder(work: Path):
    procs = [_converter(work, 1.0, 2, name) for name in ("a", "b")]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        outputs.append(out.split())
    assert outputs == [["converting", str(_target(work))]] * 2
    assert len((work / "conversions.log").read_text().split()) == 1  # the second one waited, then found it
    assert _leftovers(work) == []
    assert (_target(work) / "model.safetensors").exists()


def test_a_killed_conversion_leaves_nothing_after_the_next_one(work: Path, monkeypatch: pytest.MonkeyPatch):
    killed = _converter(work, 60.0, 1, "killed")
    assert killed.stdout is not None and killed.stdout.readline().strip() == "converting"
    deadline = time.monotonic() + 60
    while not (work / "conversions.log").exists() and time.monotonic() < deadline:  # inside save_pretrained
        time.sleep(0.01)
    killed.kill()
    killed.wait()
    assert _leftovers(work) == [f"model-64.tmp{killed.pid}"]
    _install_fakes(monkeypatch, work)
    assert models.embedded_model_dir() == _target(work)
    assert _leftovers(work) == [] and (_target(work) / "model.safetensors").exists()


def test_a_stale_temporary_folder_is_removed_once_the_model_is_there(work: Path, monkeypatch: pytest.MonkeyPatch):
    _install_fakes(monkeypatch, work)
    target = models.embedded_model_dir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = target.with_name(f"{target.name}.tmp{int(dead.stdout)}")
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    alive = target.with_name(f"{target.name}.tmp{os.getppid()}")  # a live process's: left alone
    alive.mkdir()
    assert models.embedded_model_dir() == target
    assert _leftovers(work) == [alive.name]


def test_a_failed_conversion_removes_its_temporary_folder(work: Path, monkeypatch: pytest.MonkeyPatch):
    _install_fakes(monkeypatch, work, fail=True)
    with pytest.raises(OSError, match="fake"):
        models.embedded_model_dir()
    assert _leftovers(work) == [] and not _target(work).exists()
