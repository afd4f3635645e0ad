"""The three layers are visible in the file tree and each knows only the one below it."""
import ast
import pathlib

import aoprim.server

PKG = pathlib.Path(aoprim.server.__file__).resolve().parent

# module -> server modules it may import (relative names); None = anything
ALLOWED = {
    "loop": set(),                                   # Layer 1: nothing of the server
    "framing": set(),                                # pure
    "workers": set(),                                # generic completion-queue threads
    "session": {"loop", "framing", "workers"},       # Layer 2: Layer 1 (+ framing)
    "handler": set(),                                # Layer 3: nothing below by import
    "apps": {"handler"},
    "protocol": {"handler"},
}
FORBIDDEN_STDLIB = {
    "handler": {"socket", "selectors", "select"},
    "apps": {"socket", "selectors", "select"},
    "protocol": {"socket", "selectors", "select"},
    "framing": {"socket", "selectors", "select"},
    "loop": {"socket"},
}


def imports_of(path):
    tree = ast.parse(path.read_text())
    server_mods, top = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top.add(a.name.split(".")[0])
                if a.name.startswith("aoprim.server."):
                    server_mods.add(a.name.split(".")[2])
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level >= 1:
                if mod:
                    server_mods.add(mod.split(".")[0])
                else:
                    server_mods.update(a.name for a in node.names)
            else:
                top.add(mod.split(".")[0])
                if mod.startswith("aoprim.server"):
                    rest = mod.split(".")[2:]
                    server_mods.update(rest[:1] or [a.name for a in node.names])
    return server_mods, top


def test_every_layer_module_exists():
    for name in ALLOWED:
        assert (PKG / f"{name}.py").exists(), name


def test_each_layer_imports_only_the_one_below():
    for name, allowed in ALLOWED.items():
        server_mods, top = imports_of(PKG / f"{name}.py")
        extra = server_mods - allowed
        assert not extra, f"{name}.py imports {sorted(extra)} (allowed: {sorted(allowed)})"
        bad = top & FORBIDDEN_STDLIB.get(name, set())
        assert not bad, f"{name}.py imports {sorted(bad)}"


def test_primitives_come_from_public_names():
    for path in PKG.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert not node.module.startswith("aoprim._"), \
                    f"{path.name} imports private module {node.module}"


def test_the_checker_catches_a_violation(tmp_path):
    p = tmp_path / "bad.py"
    p.write_text("import socket\nfrom .session import Session\nfrom aoprim.server import loop\n")
    mods, top = imports_of(p)
    assert mods == {"session", "loop"} and "socket" in top
