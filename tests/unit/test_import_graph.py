"""The package's imports point one way: configs and types at the bottom, then routing / layout /
permutation, then backends, then the dispatcher, then the model, then the tools and the command
line (``scripts/import_graph.py`` draws the graph and holds the layers)."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "import_graph.py"


@pytest.fixture(scope="module")
def ig():
    spec = importlib.util.spec_from_file_location("fd_import_graph", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def test_every_module_has_a_layer(ig):
    for mod in ig.graph():
        ig.layer_of(mod)


def test_no_import_circle_inside_the_package(ig):
    assert ig.circles(ig.graph()) == []


def test_no_arrow_points_up_a_layer(ig):
    assert ig.upward(ig.graph()) == []


@pytest.mark.parametrize(
    "low, high",
    [
        ("config", "backends.deepep.sizing"),
        ("backends.deepep.v1.backend", "planner"),
        ("backends.deepep.v1.low_latency", "dispatch.decode"),
        ("backends.deepep.v1.low_latency", "dispatch.dispatcher"),
    ],
)
def test_the_arrows_that_used_to_point_up_are_gone(ig, low, high):
    assert high not in ig.graph()[low]
    assert ig.layer_of(high) > ig.layer_of(low)


def test_the_checker_sees_circles_and_upward_arrows(ig):
    g = {"types": {"backends.x"}, "backends.x": {"backends.y"}, "backends.y": {"backends.x"}}
    assert ig.circles(g) == [["backends.x", "backends.y"]]
    assert ig.upward(g) == [("types", "backends.x")]


def test_lazy_and_relative_imports_count_type_checking_ones_do_not(ig, tmp_path):
    import ast

    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from flexdispatch.dispatch.dispatcher import FlexDispatcher\n"
        "def f():\n    from flexdispatch.backends.torch import hier as torch_hier\n"
        "from . import base\n"
    )
    found = ig._imports(ast.parse(src), "backends.counts", False)
    targets = {d.partition("|")[0] for d in found}
    assert "backends.torch.hier" in targets and "backends.base" in targets
    assert not any(t.startswith("dispatch") for t in targets)


def test_big_modules_were_split():
    root = _PATH.parents[1] / "flexdispatch"
    for rel in ("backends/torch/a2a.py", "doctor/__init__.py"):
        n = len((root / rel).read_text().splitlines())
        assert n < 700, f"{rel} has {n} lines"


def test_the_folders_say_what_the_layers_say(ig):
    # the package's top-level units (modules and packages, scripts/ and benchmarks/) and the
    # arrows between them stay few, and the top level holds few modules
    names, arrows = ig.units()
    assert len(names) <= 25 and len(arrows) <= 100, (len(names), len(arrows))
    top = sorted(p.name for p in ig.ROOT.glob("*.py"))
    assert len(top) <= 12, top
