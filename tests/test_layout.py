"""The one-way flow of DESIGN.md / STYLE.md, checked on the source: text → decoder → Trace/result → pandas/plots
→ app. A module may import what sits upstream of it at module level; downstream modules only lazily, inside
the method that hands a result on (`Trace.plot_attention` imports plots when called). Does not check what
the code does at run time, only where its imports point."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "slmviz"
# module -> modules it must never import at module level (the ones downstream of it, or beside it)
FORBIDDEN = {
    "model": {"trace", "plots", "patch_plots", "compare", "lens", "model_api", "pandas", "plotly", "gradio"},
    "hooks": {"trace", "plots", "model", "model_api"},
    "variants": {"trace", "plots", "model", "model_api"},
    "trace": {"plots", "patch_plots", "compare", "lens", "model_api", "plotly"},
    "plots": {"trace", "model_api", "patching", "scan"},
    "patch_plots": {"trace", "model_api", "patching"},
    "compare": {"trace", "plots"},
    "lens": {"trace", "plots"},
}


def module_level_imports(path: Path) -> set[str]:
    """Top-level slmviz modules (and third-party roots) imported outside functions and TYPE_CHECKING blocks."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, ast.FunctionDef | ast.ClassDef) else []:
            if isinstance(sub, ast.ImportFrom):
                module = sub.module or ""
                if sub.level:  # relative: .trace, ..hooks, .model.block
                    found.add(module.split(".")[0] if module else "")
                else:
                    found.add(module.split(".")[0])
            elif isinstance(sub, ast.Import):
                found |= {alias.name.split(".")[0] for alias in sub.names}
    return found


def _files(name: str) -> list[Path]:
    folder = PACKAGE / name
    return sorted(folder.glob("*.py")) if folder.is_dir() else [PACKAGE / f"{name}.py"]


@pytest.mark.parametrize("name", list(FORBIDDEN))
def test_modules_import_only_upstream_at_module_level(name):
    for path in _files(name):
        bad = module_level_imports(path) & FORBIDDEN[name]
        assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {sorted(bad)} at module level"


def test_the_library_never_imports_gradio():
    """Not even lazily: the app turns library results into components, never the other way round."""
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("gradio", "gradio_client") for n in names), path
