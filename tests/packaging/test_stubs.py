"""The .pyi stubs shipped for every compiled module describe what the module really has:
every public class and method in the stub exists at run time, and every public method or
property of a runtime class is in its stub (so mypy and IDEs see the whole API)."""
import ast
import importlib
import pathlib

import pytest

import aoprim

PKG = pathlib.Path(aoprim.__file__).parent
# every compiled module, at any depth of the package (the primitives at the top, the server's
# in server/, the asyncio loop's in aio/, ...), as its path without the suffix:
# "_atomic", "server/_receiver"
COMPILED = sorted(str(p.relative_to(PKG).parent / p.name.split(".")[0])
                  for p in PKG.rglob("_*.so"))


def _stub_classes(path):
    tree = ast.parse(path.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
            out[node.name] = names
    return out


def test_every_compiled_module_has_a_stub_and_pxd():
    assert COMPILED, "no compiled modules found in the installed package"
    assert "_atomic" in COMPILED and "server/_receiver" in COMPILED, COMPILED
    for mod in COMPILED:
        assert (PKG / f"{mod}.pyi").is_file(), f"{mod}.pyi missing"
        assert (PKG / f"{mod}.pxd").is_file(), f"{mod}.pxd missing"
    assert (PKG / "py.typed").is_file()


@pytest.mark.parametrize("mod", COMPILED)
def test_stub_matches_runtime(mod):
    m = importlib.import_module("aoprim." + mod.replace("/", "."))
    for cls_name, stub_names in _stub_classes(PKG / f"{mod}.pyi").items():
        if cls_name.startswith("_"):
            continue            # a stub-only helper (e.g. a Protocol), not a runtime class
        cls = getattr(m, cls_name, None)
        assert cls is not None, f"{mod}.pyi declares {cls_name}, the module has none"
        for name in stub_names:
            if name in ("__init__", "__buffer__", "__release_buffer__"):
                continue    # typing-only spellings (PEP 688's buffer protocol on 3.11)
            assert hasattr(cls, name), f"{mod}.pyi: {cls_name}.{name} missing at run time"
        runtime = {n for n in vars(cls) if not n.startswith("_")}
        missing = runtime - stub_names
        assert not missing, f"{mod}.pyi lacks {cls_name}: {sorted(missing)}"


def _bound_names(body):
    """Names a module's top-level statements bind, as a type checker reads them: imports,
    defs, classes and assignments, including those under ``if`` (``if TYPE_CHECKING:``) and
    ``try``.  A name a module only produces from ``__getattr__`` at run time is not here."""
    names = set()
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If):
            names |= _bound_names(node.body) | _bound_names(node.orelse)
        elif isinstance(node, ast.Try):
            names |= _bound_names(node.body) | _bound_names(node.orelse)
            for h in node.handlers:
                names |= _bound_names(h.body)
    return names


def _literal_all(path):
    """(module AST, its literal ``__all__`` list) -- or None when it has none."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "__all__"):
            return tree, ast.literal_eval(node.value)
    return None


# every pure-Python module of the package that declares a literal __all__
PY_MODULES = sorted(p for p in PKG.rglob("*.py")
                    if "__pycache__" not in p.parts and _literal_all(p) is not None)


def test_pure_python_modules_with_all_exist():
    assert PKG / "server" / "__init__.py" in PY_MODULES


@pytest.mark.parametrize("path", PY_MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_all_names_are_visible_to_type_checkers(path):
    # a pure-Python module's annotations are its stub: a name in __all__ that only the
    # module's __getattr__ makes (a lazy import) is missing for mypy and for
    # `mypy.stubtest aoprim` (.ci/package) unless an `if TYPE_CHECKING:` import binds it
    tree, exported = _literal_all(path)
    unbound = sorted(set(exported) - _bound_names(tree.body))
    assert not unbound, f"{path.relative_to(PKG)}: __all__ names no statement binds: {unbound}"
