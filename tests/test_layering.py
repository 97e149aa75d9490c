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
    does not exist. A worker's start imports no matplotlib (train/metrics.py draws the heatmaps with it, on
    rank 0 when one is due: ~0.4 s of CPU that every other start of every rank would pay)."""
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-c", "import sys, flashtrain.model, flashtrain.train, flashtrain.parallel, "
                         "flashtrain.data, flashtrain.config, flashtrain.train.trainer; "
                         "print(flashtrain.model.__file__, 'matplotlib' in sys.modules)"],
                        cwd=tmp_path, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    path, matplotlib = ok.stdout.split()
    assert Path(path).resolve() == ROOT / "model" / "__init__.py"
    assert matplotlib == "False"
    for name in ("model", "train", "parallel", "data"):
        bad = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
        assert bad.returncode != 0 and "No module named" in bad.stderr, name


PACKAGES = {"conf": "flashtrain.config", "model": "flashtrain.model", "parallel": "flashtrain.parallel",
            "train": "flashtrain.train", "data": "flashtrain.data"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            rel = rel[:-1] if rel[-1] == "__init__" else rel
            out[".".join((pkg, *rel))] = path
    return out


def _imported(name: str, path: Path, modules: dict) -> set[str]:
    """The project modules `name` imports anywhere (inside functions too): `from a.b import c` counts a.b and, when
    a module, a.b.c."""
    got = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        got |= {t for t in targets if t in modules and t != name}
    return got


def test_no_import_circle_anywhere_in_the_package():
    """Issue 51: no module of the package reaches itself through imports, lazy (inside functions) ones included."""
    modules = _modules()
    graph = {m: _imported(m, p, modules) for m, p in modules.items()}
    for start in graph:  # a depth-first walk from each module: a path back to it is a circle
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                assert nxt != start, "import circle: " + " -> ".join(path + [start])
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))


def test_train_is_the_loop_and_the_step_with_rooms_beside_them():
    """Issue 51's shape of train/: at most 18 modules at its top level, at most 12 imports inside functions (those
    left import heavy optional packages when used), and a trainer of at most 260 lines that names no stage."""
    assert len(list((ROOT / "train").glob("*.py"))) <= 18
    inside = [(path.relative_to(ROOT), node.lineno) for path in (ROOT / "train").rglob("*.py")
              for fn in ast.walk(ast.parse(path.read_text())) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert len(set(inside)) <= 12, sorted(set(inside))
    trainer = (ROOT / "train" / "trainer.py").read_text()
    assert len(trainer.splitlines()) <= 260 and "dspark" not in trainer.lower()
    assert "dspark" not in (ROOT / "train" / "plan" / "estimate.py").read_text().lower()
