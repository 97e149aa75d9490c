"""DESIGN.md: imports point one way, launch -> train -> parallel -> model, train -> data; model/ and
data/ import nothing from the others. Everything installs under `flashtrain` (flashtrain.model, ...);
`flashtrain.config.errors` (conf/errors.py) is the bottom module every package may import."""

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
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            assert not {n.split(".")[0] for n in names} & set(FORBIDDEN), \
                f"{path.relative_to(ROOT)} imports a top-level project package: use flashtrain.{names[0]}"
            roots = {n.split(".")[1] for n in names if n.startswith("flashtrain.") and n.count(".") >= 1}
            bad = roots & FORBIDDEN[package]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_bottom_module_imports_nothing_from_the_project():
    tree = ast.parse((ROOT / "conf" / "errors.py").read_text())
    imported = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not imported, "flashtrain.errors must stay importable by every package"


def test_installed_names_are_under_flashtrain_only(tmp_path):
    """pip install -e . claims no top-level name but `flashtrain` (issue 30 item 8): from a directory
    with no project folders in it, `flashtrain.model` / `.train` import from this checkout and `model`
    does not exist."""
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-c", "import flashtrain.model, flashtrain.train, flashtrain.parallel, "
                         "flashtrain.data, flashtrain.config; print(flashtrain.model.__file__)"],
                        cwd=tmp_path, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert Path(ok.stdout.strip()).resolve() == ROOT / "model" / "__init__.py"
    for name in ("model", "train", "parallel", "data"):
        bad = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
        assert bad.returncode != 0 and "No module named" in bad.stderr, name
