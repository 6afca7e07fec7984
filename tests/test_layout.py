"""The package's parts and the one-way flow between them (docs/layout.md), checked on the source.

Every top-level module or subpackage of slmviz is one *part*, and `PARTS` orders them: a part may import the
parts listed before it, never one listed after it or beside it in the same row. This holds for every import
in the code, module-level and function-level alike; only `if TYPE_CHECKING:` blocks are exempt (they never
run). The one kind of upward import allowed is a result's figure method importing its plotting module when
called (`Trace.plot_attention` -> `slmviz.plots.trace`), and `UPWARD` names each of them. Inside a part,
modules may import each other, but no chain of imports (function-level ones included) may come back round.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "slmviz"

PARTS: list[set[str]] = [  # lowest first
    {"config", "tokens", "hooks", "variants", "errors", "progress"},  # the contracts every part reads
    {"metrics", "model"},  # metrics on logits; the decoder
    {"loading"},  # weights, bundled models, the transformers reference
    {"analysis"},  # read-outs of finished traces (lens, logit attribution, diffs)
    {"trace"},  # the Trace result
    {"model_api"},  # Model and load: trace / generate / stream
    {"corpora"},  # every corpus: reading, the bundled verses, broad, the model-written ones
    {"interventions", "scans"},  # patching, ablation, compare; corpus scans
    {"formats"},  # one module per file format: configs and tensors in and out, no objects
    {"features"},  # one sparse coder: splice into traces, scans and patches; steer, label, evaluate
    {"replacement"},  # what attribution graphs run on: the PLT set and the CLT behind one interface
    {"training"},  # one trainer for every coder
    {"circuits", "graphs"},  # component circuits (EAP); attribution graphs and their workbench
    {"plots"},  # figures of every result
    {"cli", "__init__"},  # the entry points
]
RANK = {part: i for i, row in enumerate(PARTS) for part in row}

# (module, function or method that imports, part it imports): figure methods of result types.
UPWARD = {
    ("slmviz.trace", "Trace.plot_attention", "plots"),
    ("slmviz.trace", "Trace.plot_residual_norms", "plots"),
    ("slmviz.trace", "Trace.plot_logit_lens", "plots"),
    ("slmviz.trace", "Trace._repr_html_", "plots"),  # the notebook card is a figure too
    ("slmviz.interventions.result", "PatchResult.plot", "plots"),
    ("slmviz.interventions.features", "FeaturePatchResult.plot", "plots"),
    ("slmviz.scans.scan", "Scan.plot_histogram", "plots"),
    ("slmviz.scans.scan", "Scan.examples_html", "plots"),
    ("slmviz.circuits.circuit", "Circuit.plot", "plots"),
    ("slmviz.graphs.subgraph", "Subgraph.plot", "plots"),  # the pinned subgraph's figure
    ("slmviz.features.dashboard", "FeatureCard.html", "plots"),
    ("slmviz.features.dashboard", "FeatureCard._repr_html_", "plots"),  # the notebook card
    ("slmviz.circuits.circuit", "Circuit.plot_faithfulness", "plots"),
    ("slmviz.graphs.graph", "AttributionGraph.plot", "plots"),
    ("slmviz.graphs.qk", "QKAttribution.plot", "plots"),  # the QK heat map
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """slmviz.scans.batches -> scans; slmviz -> __init__."""
    rest = module.split(".")[1:]
    return rest[0] if rest else "__init__"


def imports(path: Path) -> Iterator[tuple[str, str]]:
    """(slmviz module imported, the def/class path that imports it, "" at module level), TYPE_CHECKING skipped."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]

    def absolute(node: ast.ImportFrom) -> list[str]:
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            root = ".".join(base + ([node.module] if node.module else []))
        else:
            root = node.module or ""
        # `from . import plots` imports a module; `from .x import name` the module x
        return [f"{root}.{a.name}" if node.module is None else root for a in node.names]

    def walk(node: ast.AST, where: list[str]) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom):
                for target in absolute(child):
                    yield target, ".".join(where)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, ".".join(where)
            inner = [*where, child.name] if isinstance(child, ast.FunctionDef | ast.ClassDef) else where
            yield from walk(child, inner)

    tree = ast.parse(path.read_text(encoding="utf-8"))
    for target, where in walk(tree, []):
        if target == "slmviz" or target.startswith("slmviz."):
            yield target, where


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_part_has_a_place():
    parts = {part_of(module_name(p)) for p in SOURCES}
    assert parts <= set(RANK), f"place these in PARTS: {sorted(parts - set(RANK))}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    module = module_name(path)
    if part_of(module) in ("__init__", "cli"):
        return  # the entry points import everything
    mine = part_of(module)
    for target, where in imports(path):
        theirs = part_of(target)
        if theirs == mine or theirs == "__init__" and target == "slmviz" and where:
            continue  # inside one part (cycles are checked below); `import slmviz` at call time is the public API
        if RANK[theirs] < RANK[mine]:
            continue
        assert (module, where, theirs) in UPWARD, (
            f"{module} ({where or 'module level'}) imports {target}: part {theirs!r} is not below {mine!r} in PARTS")


def test_named_upward_imports_exist():
    """UPWARD lists only what the code does: a removed figure method must leave the list too."""
    found = {(module_name(p), where, part_of(t)) for p in SOURCES for t, where in imports(p)}
    assert found >= UPWARD, sorted(UPWARD - found)


def test_no_import_cycles():
    """Among modules, function-level imports included, except the named figure methods."""
    graph: dict[str, set[str]] = {}
    modules = {module_name(p) for p in SOURCES}
    for p in SOURCES:
        src = module_name(p)
        if part_of(src) in ("__init__", "cli"):
            continue
        for target, where in imports(p):
            if (src, where, part_of(target)) in UPWARD:
                continue
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != src and target in modules and part_of(target) not in ("__init__",):
                graph.setdefault(src, set()).add(target)

    assert_no_cycle(graph, "import cycle")


def assert_no_cycle(graph: dict[str, set[str]], what: str) -> None:
    """Fail naming the first cycle of `graph` ({module: modules it imports}) a depth-first walk meets."""
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
                pytest.fail(f"{what}: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_library_never_imports_gradio():
    """Not even lazily: the app turns library results into components, never the other way round."""
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("gradio", "gradio_client") for n in names), path


APP = PACKAGE.parent / "app"


def app_imports() -> dict[str, list[tuple[str, list[str]]]]:
    """{app module: [(app module it imports, the names it takes)]}, function-level imports included."""
    found: dict[str, list[tuple[str, list[str]]]] = {}
    for path in sorted(APP.rglob("*.py")):
        parts = list(path.relative_to(APP.parent).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        edges = found.setdefault(module, [])
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                if target == "app" or target.startswith("app."):
                    edges.append((target, [a.name for a in node.names]))
    for edges in found.values():  # `from . import shared` imports the module app.shared, not the package
        edges[:] = [(f"{dst}.{name}", []) if f"{dst}.{name}" in found else (dst, [name])
                    for dst, names in edges for name in names]
    return found


def test_the_app_has_no_import_circle_and_imports_no_private_name_across_modules():
    """The app's modules import one way too, and no module reaches into another's `_private` names (0.2's
    Circuits tab and workbench imported each other's private helpers)."""
    found = app_imports()
    private = [(src, dst, name) for src, edges in found.items() for dst, names in edges for name in names
               if name.startswith("_") and not name.startswith("__")]
    assert not private, f"private names imported across app modules: {private}"
    graph = {src: {dst for dst, _ in edges if dst in found and dst != src} for src, edges in found.items()}
    assert_no_cycle(graph, "app import cycle")


def test_hook_names_are_built_and_read_by_the_hooks_helpers():
    """A layer's hook name is made by hooks.layer_hook_name and its layer read by hooks.layer_of, never by an
    f"blocks.{L}..." string or split(".")[1] of its own: one place to change if a family's names ever differ (the
    families issue counted 64 f-strings against 7 uses of the helper)."""
    import re

    root = PACKAGE.parent
    made = re.compile(r"""f["']blocks\.\{""")
    read = re.compile(r"""\.split\(["']\.["']\)\[1\]""")
    found = [f"{path.relative_to(root)}:{i}" for part in ("slmviz", "app")
             for path in sorted((root / part).rglob("*.py")) if path.name != "hooks.py"
             for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if made.search(line) or read.search(line)]
    assert not found, f"use hooks.layer_hook_name / hooks.layer_of: {found}"
