"""The package's imports run one way (downhill through its layers), at module
level only, and ``import rumus_fx`` loads no test or optional dependency.

The layers, lowest first (a module may import its own layer and lower ones;
inside a layer the imports form no cycle):

    base:       errors, sharding, eager, lazy, compiler (no rumus_fx imports but each other)
    kernels:    kernels.*                   (plain jax: the Pallas kernels and references)
    storage:    storage
    recording:  recording                   (which tape records; no_grad)
    tensor:     tensor
    autograd:   autograd.*                  (records, tape, engine, transforms)
    ops:        ops.*, debug                (debug registers the engine's anomaly hook)
    lift:       lift.*                      (registers rf.lift with the transforms)
    namespaces: _mirror, numpy, lax, tensor_methods (installs Tensor's op methods)
    nn:         nn.*
    top:        rumus_fx (the package), testing

Importing ``a.b.c`` runs the packages ``a.b`` above it, so an import of a
submodule counts as an import of every package it sits in (outside the
importer's own packages). Imports under ``if TYPE_CHECKING:`` never run and are
not counted.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "rumus_fx"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("rumus_fx.errors", "rumus_fx.sharding", "rumus_fx.eager", "rumus_fx.lazy", "rumus_fx.compiler")),
    ("kernels", ("rumus_fx.kernels",)),
    ("storage", ("rumus_fx.storage",)),
    ("recording", ("rumus_fx.recording",)),
    ("tensor", ("rumus_fx.tensor",)),
    ("autograd", ("rumus_fx.autograd",)),
    ("ops", ("rumus_fx.ops", "rumus_fx.debug")),
    ("lift", ("rumus_fx.lift",)),
    ("namespaces", ("rumus_fx._mirror", "rumus_fx.numpy", "rumus_fx.lax", "rumus_fx.tensor_methods")),
    ("nn", ("rumus_fx.nn",)),
    ("top", ("rumus_fx", "rumus_fx.testing")),
]

# imports inside functions that are allowed: optional dependencies only
# (module, name imported lazily)
OPTIONAL = {("rumus_fx", "testing")}  # rumus_fx.testing imports chex: loaded on first use


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (p, is_pkg)
    return out


MODULES = _modules()


def _resolve(mod: str, is_pkg: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The rumus_fx modules an import statement loads (its targets)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "rumus_fx"]
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        if node.level > 1:
            base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "rumus_fx":
        return []
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else target)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_module_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported (not in functions, not
    under ``if TYPE_CHECKING:``)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, (ast.Try, ast.With)):
                visit(node.body)
                for h in getattr(node, "handlers", ()):
                    visit(h.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))
            elif isinstance(node, ast.ClassDef):
                visit(node.body)

    visit(tree.body)
    return found


def _layer(mod: str) -> int:
    best, depth = None, -1
    for k, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and p.count(".") > depth:
                best, depth = k, p.count(".")
    assert best is not None, f"{mod} is in no layer: add it to LAYERS in tests/test_imports.py"
    return best


def _edges() -> dict[str, set[str]]:
    """module -> the rumus_fx modules its import runs (with the packages that
    importing a submodule runs, outside the importer's own packages)."""
    edges: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        own = {".".join(mod.split(".")[:k]) for k in range(1, mod.count(".") + 2)}
        targets: set[str] = set()
        for node in _runtime_module_imports(tree):
            for t in _resolve(mod, is_pkg, node):
                parts = t.split(".")
                for k in range(2, len(parts) + 1):  # the packages above t, and t
                    name = ".".join(parts[:k])
                    if name not in own or name == t:
                        targets.add(name)
        targets.discard(mod)
        edges[mod] = {t for t in targets if t in MODULES}
    return edges


def test_every_module_is_parsed():
    assert len(MODULES) > 50
    for name in ("rumus_fx.errors", "rumus_fx.storage", "rumus_fx.tensor", "rumus_fx.autograd.engine"):
        assert name in MODULES


def test_no_function_level_imports_of_rumus_fx_modules():
    """A function-level import of a package module hides a cycle; only optional
    dependencies (safetensors, a lazily loaded rumus_fx.testing) load late."""
    found = []
    for mod, (path, is_pkg) in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and _resolve(mod, is_pkg, node):
                    found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} ({getattr(fn, 'name', 'lambda')})")
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
                    arg = node.args[0]
                    name = arg.value if isinstance(arg, ast.Constant) else None
                    if isinstance(name, str) and (name.startswith(".") or name.startswith("rumus_fx")):
                        if (mod, name.lstrip(".")) not in OPTIONAL:
                            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} import_module({name!r})")
    assert not found, "function-level imports of rumus_fx modules:\n" + "\n".join(found)


def test_imports_run_down_the_layers():
    bad = []
    for mod, targets in _edges().items():
        for t in sorted(targets):
            if _layer(t) > _layer(mod):
                bad.append(f"{mod} ({LAYERS[_layer(mod)][0]}) imports {t} ({LAYERS[_layer(t)][0]})")
    assert not bad, "imports that run up the layers:\n" + "\n".join(bad)


def test_no_import_cycles():
    edges = _edges()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycle = [*stack[stack.index(t) :], t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_the_checks_see_a_violation():
    """The parser finds the imports the checks are about."""
    tree = ast.parse(
        "from .ops import add\n"
        "if TYPE_CHECKING:\n    from .nn import Linear\n"
        "def f():\n    from . import ops\n"
        "try:\n    from .lift import lift\nexcept ImportError:\n    pass\n"
    )
    found = [t for n in _runtime_module_imports(tree) for t in _resolve("rumus_fx.tensor", False, n)]
    assert found == ["rumus_fx.ops", "rumus_fx.lift"]
    assert _layer("rumus_fx.ops.shape") > _layer("rumus_fx.tensor")
    assert _layer("rumus_fx.kernels.precision") < _layer("rumus_fx.storage")


def test_import_loads_no_test_or_optional_dependency():
    code = (
        "import rumus_fx, sys; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('pytest', 'hypothesis', 'optax', 'chex', 'torch', 'safetensors', 'sklearn', 'matplotlib')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT.parent, timeout=300
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_import_starts_no_jax_backend():
    """``jax.distributed.initialize()`` must run before any computation, and a
    multi-host script imports rumus_fx first: the import makes no array."""
    code = "import jax._src.xla_bridge as xb, rumus_fx; print(bool(xb._backends))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def _op_imports(path: pathlib.Path, package: str) -> dict[str, str]:
    """``{name: module}`` of the explicit re-exports ``from .<family> import
    <name> as <name>`` (``from .ops.<family> ...`` in the top package) at the
    module level of ``path``, that name a declared op's forward."""
    from rumus_fx.autograd.registry import declarations

    forwards = {d.fn for d in declarations("op")}
    mod = importlib.import_module(package)
    out = {}
    for node in ast.parse(path.read_text()).body:
        if not (isinstance(node, ast.ImportFrom) and node.level == 1 and node.module):
            continue
        if package == "rumus_fx" and not node.module.startswith("ops."):
            continue
        for a in node.names:
            name = a.asname or a.name
            assert a.asname in (None, a.name), f"{path}: {a.name} re-exported as {a.asname}"
            if getattr(mod, name, None) in forwards:
                out[name] = node.module
    return out


@pytest.mark.parametrize("package, toplevel", [("rumus_fx", True), ("rumus_fx.ops", False)])
def test_static_op_names_are_the_declared_ops(package, toplevel):
    """The op names are exported one by one, ``from .<family> import <op> as
    <op>`` (what IDEs and type checkers read); they must be exactly the
    declared ops, from the modules that define them."""
    import rumus_fx  # noqa: F401  (declares every op)
    from rumus_fx.autograd.registry import exports

    path = ROOT / ("__init__.py" if package == "rumus_fx" else "ops/__init__.py")
    static = _op_imports(path, package)
    declared = exports(toplevel=toplevel)
    assert sorted(static) == sorted(declared)
    for name, fn in declared.items():
        assert fn.__name__ == name
        assert fn.__module__.endswith("." + static[name].split(".")[-1]), (name, fn.__module__, static[name])


def test_no_runtime_export_from_the_registry():
    """No ``globals().update(...)``: a name a type checker cannot see is not exported."""
    for path in (ROOT / "__init__.py", ROOT / "ops" / "__init__.py"):
        assert "globals()" not in path.read_text(), path


# the exceptions, each with its reason at the import: a tracked Tensor passed to a plain
# JAX function is refused with rf's message through JAX's type registry
# (pytype_aval_mappings), for which JAX has no public hook; the mutable array references
# a lifted function makes itself are discharged by jax's state discharge, which has no
# public name (Note in lift/jax_versions.py)
PRIVATE_JAX_ALLOWED = {
    ("tensor.py", "from jax._src import core as _jax_core"),
    ("jax_versions.py", "from jax._src.state import discharge as _discharge  # isort: skip"),
}


def test_no_jax_private_modules():
    """rumus_fx reads JAX through its public modules only: no ``jax._src``
    import, attribute or logger name anywhere in the package."""
    found = [
        f"{path.relative_to(ROOT.parent)}:{k}"
        for path, _ in MODULES.values()
        for k, line in enumerate(path.read_text().splitlines(), 1)
        if "jax._src" in line and (path.name, line) not in PRIVATE_JAX_ALLOWED
    ]
    assert not found, "jax._src in rumus_fx:\n" + "\n".join(found)
