
"""Runs tests/triton_interpret/ in a fresh process with TRITON_INTERPRET=1, so that the Triton kernels
execute on CPU tensors in Triton's interpreter and are compared with their plain-PyTorch references."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/triton_interpret"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]
