"""mhla.targets: one table per device kind, the docs hold it, and the scripts that read it restate none of it."""
import ast
import math
import re

import pytest
from helpers import ROOT

from mhla import targets as goals

SCRIPTS = ("benchmark", "benchmark_attention", "gpu_check")  # the scripts that report targets
GOAL = re.compile(r"(>=|<=)\s*\d")


def test_each_device_kind_reads_its_own_table():
    assert goals.device_kind("cpu") == "cpu" and goals.device_kind("cuda:1") == "gpu"
    for device, kind in (("cpu", "cpu"), ("cuda", "gpu")):
        table = goals.for_device(device)
        entries = [t for t in goals.TARGETS if t.device == kind]
        assert list(table.values()) == entries  # every entry of the kind, each name once
    assert {t.device for t in goals.TARGETS} == set(goals.DEVICES)
    assert {t.op for t in goals.TARGETS} == {">=", "<="}
    assert all(t.description and math.isfinite(t.value) and t.value > 0 for t in goals.TARGETS)


def test_a_target_prints_its_bound_and_says_whether_a_ratio_meets_it():
    at_least = goals.Target("x", "gpu", ">=", 5, "")
    at_most = goals.Target("y", "cpu", "<=", 1 / 3, "")
    assert (at_least.goal, at_most.goal) == (">= 5", "<= 0.333")
    assert [at_least.met(r) for r in (5.0, 4.99, 50.0, math.nan)] == [True, False, True, False]
    assert [at_most.met(r) for r in (1 / 3, 0.334, 0.1, math.nan)] == [True, False, True, False]


def test_the_docs_hold_the_table_as_rendered():
    rendered = goals.markdown()
    for target in goals.TARGETS:  # each entry is a row of its device's table
        assert f"| `{target.name}` | {target.goal} | {target.description} |" in rendered
    assert rendered in (ROOT / "docs" / "benchmarks.md").read_text()


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_scripts_state_no_target_of_their_own(script):
    """No goal string (docstrings included), no comparison with a table's value and no non-integer table value
    as a literal: every bound comes from ``mhla.targets``."""
    values = {t.value for t in goals.TARGETS}
    tree = ast.parse((ROOT / "scripts" / f"{script}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert not GOAL.search(node.value), node.value
        if isinstance(node, ast.Constant) and isinstance(node.value, float):
            assert node.value.is_integer() or node.value not in values, (node.lineno, node.value)
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.GtE, ast.LtE)) for op in node.ops):
            numbers = [n.value for n in [node.left, *node.comparators] if isinstance(n, ast.Constant)]
            assert not set(numbers) & values, (node.lineno, numbers)
