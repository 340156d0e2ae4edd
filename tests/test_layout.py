"""The package layout is the architecture: imports go one way, and no module reaches into
another's private names."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "alpa_lite"

# Each layer may import itself and the layers listed for it (and nothing above it).
# tools -> api -> runtime / planning -> plan / ir -> cost_models / solvers.
ALLOWED = {
    "solvers": set(),
    "cost_models": set(),
    "compression": set(),
    "errors": set(),
    "progress": set(),
    "static_leaves": set(),
    "ir": {"errors", "solvers"},
    "plan": {"errors", "cost_models"},
    "planning": {"ir", "plan", "cost_models", "solvers", "errors", "progress", "compression"},
    "runtime": {"ir", "plan", "cost_models", "errors", "compression"},
    "api": {"runtime", "planning", "plan", "ir", "cost_models", "errors", "progress",
            "compression", "static_leaves"},
    "tools": {"api", "runtime", "planning", "plan", "ir", "cost_models", "solvers", "errors",
              "progress", "compression"},
    "__init__": {"api", "tools", "runtime", "plan", "ir", "cost_models", "errors"},
}


def _layer(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.startswith("alpa_lite"):
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("alpa_lite"):
                    yield a.name, [], node.lineno


MODULES = sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_go_one_way(path):
    layer = _layer(path)
    allowed = ALLOWED[layer] | {layer}
    for module, names, line in _imports(path):
        parts = module.split(".")
        target = parts[1] if len(parts) > 1 else names[0] if names else "alpa_lite"
        if len(parts) == 1:       # `from alpa_lite import x`
            targets = set(names)
        else:
            targets = {target}
        bad = targets - allowed
        assert not bad, (f"{path.relative_to(PKG)}:{line} imports {module} "
                         f"({sorted(bad)}), which layer {layer!r} may not import")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_private_names_imported(path):
    for module, names, line in _imports(path):
        private = [n for n in names if n.startswith("_")]
        assert not private, (f"{path.relative_to(PKG)}:{line} imports private "
                             f"{private} from {module}")


def test_every_package_says_what_it_holds():
    for init in PKG.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(PKG)} has no docstring"


def test_builtin_models_are_user_code():
    """The built-in models (tools/models) are what a user writes: they may use the markers
    of `alpa_lite.ir` (`value_and_grad`) and each other, never planning or runtime."""
    for path in sorted((PKG / "tools" / "models").glob("*.py")):
        for module, names, line in _imports(path):
            assert module.startswith(("alpa_lite.ir", "alpa_lite.tools.models")), (
                f"{path.relative_to(PKG)}:{line} imports {module}; the built-in models may "
                "import only alpa_lite.ir and alpa_lite.tools.models")
