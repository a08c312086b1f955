"""A pytest plugin: ``--mypy`` type-checks the project with mypy beside the tests instead of before them.

mypy takes ~55 s of one core on a fresh clone (no cache), while ``pytest -n 2`` leaves a share of this suite's
two cores idle (waits on servers, Ray, subprocesses). So with ``--mypy`` the controller process starts
``python -m mypy`` (the project's ``[tool.mypy]`` configuration, from the root folder) at a lower CPU priority
when the session starts, and at the end prints its report as a ``mypy`` section; a type error (any non-zero exit
of mypy) fails the run like a failed test. Under pytest-xdist only the controller runs it, once.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROCESS = pytest.StashKey[subprocess.Popen]()
_REPORT = pytest.StashKey[tuple[int, str]]()
NICENESS = 10  # mypy yields the CPU to the tests' processes


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--mypy",
        action="store_true",
        help="type-check with mypy beside the tests (low CPU priority); its errors are reported at the end and "
        "fail the run",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--mypy") and not hasattr(config, "workerinput"):  # not in pytest-xdist's workers
        config.stash[_PROCESS] = subprocess.Popen(
            [sys.executable, "-m", "mypy"],
            cwd=config.rootpath,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=(lambda: os.nice(NICENESS)) if os.name == "posix" else None,
        )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    process = session.config.stash.get(_PROCESS, None)
    if process is None:
        return
    if session.exitstatus == pytest.ExitCode.INTERRUPTED:
        process.kill()
    output, _ = process.communicate()
    session.config.stash[_REPORT] = (process.returncode, output)
    if process.returncode != 0 and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    report = config.stash.get(_REPORT, None)
    if report is None:
        return
    returncode, output = report
    if returncode == 0:
        terminalreporter.write_line(f"mypy: {output.strip().splitlines()[-1] if output.strip() else 'passed'}")
    else:
        terminalreporter.section(f"mypy failed (exit status {returncode})", red=True)
        terminalreporter.write(output)
