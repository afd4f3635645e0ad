"""The .pyi stubs shipped for every compiled module describe what the module really has:
every public class and method in the stub exists at run time, and every public method or
property of a runtime class is in its stub (so mypy and IDEs see the whole API)."""
import ast
import importlib
import pathlib

import pytest

import aoprim

PKG = pathlib.Path(aoprim.__file__).parent
COMPILED = sorted(p.name.split(".")[0] for p in PKG.glob("_*.so"))


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
    for mod in COMPILED:
        assert (PKG / f"{mod}.pyi").is_file(), f"{mod}.pyi missing"
        assert (PKG / f"{mod}.pxd").is_file(), f"{mod}.pxd missing"
    assert (PKG / "py.typed").is_file()


@pytest.mark.parametrize("mod", COMPILED)
def test_stub_matches_runtime(mod):
    m = importlib.import_module(f"aoprim.{mod}")
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
