"""DESIGN.md: imports point one way, launch -> train -> parallel -> model, train -> data; model/ and
data/ import nothing from the others."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "model": {"data", "train", "parallel", "launch"},
    "data": {"model", "train", "parallel", "launch"},
    "parallel": {"train", "data", "launch"},
    "train": {"launch"},
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = {node.module.split(".")[0]}
            else:
                continue
            bad = roots & FORBIDDEN[package]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
