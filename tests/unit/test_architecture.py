"""The package's shape, checked from its source: its layers (docs/architecture.md), each
import pointing down or within a layer, no import circles, no module reaching into
another module's private attributes, and ``import collectives`` loading the core library
alone (the simulator, the framework adapters and the tools load on first use).

Serial: nothing here sends a message.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "collectives"
PACKAGE_NAME = "collectives"


def _modules():
    """``{module name: (path, is package)}`` of every module in the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _resolve(module, is_package, node):
    """The modules of the package that an import statement ``node`` in ``module`` names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")
            if not is_package:
                base = base[:-1]
            base = base[: len(base) - node.level + 1]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        # "from a import b": b is a module of its own when a.b is one, else a name in a
        names = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in MODULES else origin for alias in node.names]
    found = set()
    for name in names:
        while name and name not in MODULES:  # import a.b.c where only a.b is ours (an attribute)
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def _graph():
    """``{module: modules it imports}``, counting imports anywhere in it (inside
    functions too: an import put off until first use is still a dependency)."""
    graph = {}
    for module, (path, is_package) in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _resolve(module, is_package, node)
        edges.discard(module)
        graph[module] = edges
    return graph


def _cycles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_no_import_circles():
    """Every import between the package's modules points one way. A package's
    ``__init__`` counts as the module it is: ``from . import x`` in it is an edge to x,
    and x importing a name from the package is an edge back."""
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


# The package's layers, bottom first (docs/architecture.md, "The layers"): a module may
# import from its own layer and the ones below it, never from one above. A room is a
# top-level module or a subpackage of collectives ("collectives" itself: the package's
# __init__, the face users import).
LAYERS = (
    ("foundations", ("errors", "dtypes", "cache", "mpi_library", "launcher", "topology", "schedule", "_aliases")),
    ("arrays and ops", ("ops", "device", "arrays", "call")),
    ("what a collective is", ("algorithms", "options", "reference", "specs")),
    ("transport", ("transport",)),
    ("auto", ("auto",)),
    ("routes", ("routes",)),
    ("call path", ("calls", "gate", "check", "registered", "point")),
    ("communicator", ("context", "communicator", "collectives")),
    ("simulator and adapters", ("sim", "adapters")),
    ("tools", ("tools",)),
)
LAYER_OF = {room: depth for depth, (_, rooms) in enumerate(LAYERS) for room in rooms}


def _room(module):
    """The room of ``module``: ``collectives.transport.mpi`` -> ``transport``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _upward_imports(graph, layer_of):
    """``(module, imported, its layer, the imported one's layer)`` for every import
    from a layer below to one above it; a room ``layer_of`` leaves out counts as an
    error of its own (``(module, None, None, None)``): every module has a place."""
    found = []
    for module in sorted(graph):
        if _room(module) not in layer_of:
            found.append((module, None, None, None))
            continue
        for imported in sorted(graph[module]):
            here, there = layer_of[_room(module)], layer_of.get(_room(imported))
            if there is not None and there > here:
                found.append((module, imported, here, there))
    return found


def test_every_import_points_down_or_within_its_layer():
    names = [name for name, _ in LAYERS]
    assert [(module, imported, names[here] if here is not None else None, names[there] if there is not None else None)
            for module, imported, here, there in _upward_imports(_graph(), LAYER_OF)] == []


def test_the_layer_checker_finds_an_upward_import():
    layer_of = {"low": 0, "mid": 1, "top": 2}
    graph = {"collectives.low.a": {"collectives.low.b"}, "collectives.low.b": set(),
             "collectives.mid": {"collectives.low.a", "collectives.top.x"},  # the second points up
             "collectives.top.x": {"collectives.mid", "collectives.low.b"},
             "collectives.nowhere": set()}
    assert _upward_imports(graph, layer_of) == [("collectives.mid", "collectives.top.x", 1, 2),
                                                ("collectives.nowhere", None, None, None)]


def test_the_layers_name_every_room_once():
    rooms = [room for _, rooms in LAYERS for room in rooms]
    assert len(rooms) == len(set(rooms))
    assert sorted(set(rooms)) == sorted({_room(module) for module in MODULES})


def _defined_names(tree):
    """Private attribute and method names a module defines: ``self._x = ...``,
    ``def _x`` inside a class, class-level ``_x = ...`` and ``__slots__`` entries."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    for target in item.targets:
                        if isinstance(target, ast.Name):
                            names.add(target.id)
                            if target.id == "__slots__" and isinstance(item.value, (ast.Tuple, ast.List)):
                                names |= {e.value for e in item.value.elts if isinstance(e, ast.Constant)}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_reach_ins():
    """``(module, line, attribute, the module that defines it)`` for every access
    ``obj._name`` in one module of the package to a private attribute that only other
    modules of the package define (``self`` and ``cls`` aside)."""
    trees = {module: ast.parse(path.read_text(encoding="utf-8")) for module, (path, _) in MODULES.items()}
    defined = {module: _defined_names(tree) for module, tree in trees.items()}
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in defined[module]:
                continue
            owners = sorted(m for m, names in defined.items() if node.attr in names)
            if owners:
                found.append((module, node.lineno, node.attr, owners[0]))
    return found


def test_no_module_reaches_into_another_modules_private_attributes():
    assert _private_reach_ins() == []


def test_import_collectives_loads_the_core_only():
    code = ("import sys, collectives; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('collectives'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    outside = [m for m in loaded if m.startswith(("collectives.sim", "collectives.adapters", "collectives.tools"))]
    assert outside == []
    assert "collectives.communicator" in loaded


def test_the_public_names_load_on_first_use():
    code = ("import collectives as cc, collectives.horovod.torch as hvd, collectives.adapters.horovod.torch as real; "
            "import collectives.torch, collectives.training; "
            "assert hvd is real; assert cc.training is collectives.training; "
            "assert cc.sim.run and cc.ps.ParameterServer and cc.training.GradientReducer; "
            "assert collectives.torch.__name__ == 'collectives.adapters.torch'")
    pytest.importorskip("torch")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_old_names_of_auto_are_its_modules():
    code = ("import collectives.tuning as tuning, collectives.calibration as calibration, collectives.auto as auto; "
            "assert tuning is auto and calibration is auto.calibration and tuning.Selector is auto.selector.Selector")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_two_test_files_share_a_name():
    """pytest imports each test file by its name alone (the folders are no packages):
    a second file of the same name in another folder fails to collect."""
    names = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not [paths for paths in names.values() if len(paths) > 1]
