"""Every launch tool explains itself (issue 32 item 2): `--help` on each launch/*.py -- the folder is
enumerated, so a tool added later is checked too -- exits 0 and says what it takes: `+exp=NAME` and Hydra
overrides where the tool composes the configuration, and a description of every option."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = sorted((ROOT / "launch").glob("*.py"))


@pytest.fixture(scope="module")
def helps():
    """Each tool's --help output, the tools run side by side."""
    procs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True) for p in TOOLS}
    return {name: (proc.communicate(timeout=300)[0], proc.returncode) for name, proc in procs.items()}


def composes_the_configuration(source: str) -> bool:
    return any(s in source for s in ("compose(", "@hydra.main", "overrides_help("))


def undocumented_options(text: str) -> list[str]:
    """argparse's `options:` / `positional arguments:` entries without a description."""
    missing, section, lines = [], False, text.splitlines()
    for i, line in enumerate(lines):
        if line in ("options:", "positional arguments:"):
            section = True
            continue
        if section and not line.strip():
            section = False
        if not section or not re.match(r"^  \S", line):
            continue
        described = re.match(r"^  \S.*?\s{2,}\S", line) or (i + 1 < len(lines) and re.match(r"^\s{6,}\S", lines[i + 1]))
        if not described:
            missing.append(line.strip())
    return missing


@pytest.mark.parametrize("tool", [p.name for p in TOOLS])
def test_help_exits_0_and_says_what_the_tool_takes(helps, tool):
    text, code = helps[tool]
    assert code == 0 and "Traceback" not in text, text[-3000:]
    assert len(text.strip().splitlines()) >= 5, text
    if composes_the_configuration((ROOT / "launch" / tool).read_text()):
        assert "+exp=" in text and "override" in text.lower(), text
    assert undocumented_options(text) == [], text
