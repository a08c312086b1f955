"""``--mypy`` (tests/mypy_beside.py): the type check runs beside the tests, and a type error fails the run with
mypy's report, passing tests or not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

PASSING_TEST = "def test_passes():\n    assert True\n"


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A project whose mypy configuration checks ``typed.py`` only, with one passing test; its pytest finds the
    plugin (``-p mypy_beside``) in this folder."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    )
    pytester.makepyprojecttoml('[tool.mypy]\nfiles = ["typed.py"]\n')
    pytester.makepyfile(test_one=PASSING_TEST)
    return pytester


def test_a_type_error_fails_a_run_whose_tests_pass_and_mypy_reports_it(project: pytest.Pytester):
    project.makepyfile(typed="count: int = 'three'\n")
    result = project.runpytest_subprocess("-p", "mypy_beside", "--mypy")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*mypy failed (exit status 1)*", "typed.py:1: error: Incompatible types*"])


def test_a_clean_type_check_keeps_the_run_green_and_says_so(project: pytest.Pytester):
    project.makepyfile(typed="count: int = 3\n")
    result = project.runpytest_subprocess("-p", "mypy_beside", "--mypy")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["mypy: Success: no issues found in 1 source file"])


def test_without_the_option_mypy_does_not_run(project: pytest.Pytester):
    project.makepyfile(typed="count: int = 'three'\n")
    result = project.runpytest_subprocess("-p", "mypy_beside")
    output = result.stdout.str()
    assert result.ret == pytest.ExitCode.OK and "mypy:" not in output and "mypy failed" not in output
