
"""Runs tests/triton_interpret/ in a fresh process with TRITON_INTERPRET=1, so that the Triton kernels
execute on CPU tensors in Triton's interpreter and are compared with their plain-PyTorch references."""

import os
import sys
from pathlib import Path

import pytest
import warm_launch

ROOT = Path(__file__).resolve().parent.parent


FILES = sorted(p.name for p in (ROOT / "tests" / "triton_interpret").glob("test_*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES)
def test_triton_kernels_under_interpreter(name):
    """One process per file, so that the files can run side by side (pytest-xdist); each forked from a
    warm interpreter that imported Triton and the kernels with TRITON_INTERPRET=1 (tests/warm_launch.py)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = warm_launch.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                           f"tests/triton_interpret/{name}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]


def test_every_interpreter_file_is_run():
    assert len(FILES) == 7 and {"test_model_kernels.py", "test_compiled_kernels.py",
                                "test_fp8_gemm_kernel.py"} <= set(FILES)
