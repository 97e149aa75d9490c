"""launch/pretrain.py's torchrun conventions (issue 17 item 6): a configuration or input error is one line
naming the value and the fix, exit status 2, no traceback; an unexpected error goes through
torch.distributed.elastic's `record`, which writes the rank's error file; Hydra's job log receives the
trainer's log lines."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pretrain(run_dir, *overrides, env=None):
    return subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny",
                           f"hydra.run.dir={run_dir}", "logging.wandb.mode=disabled", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_an_input_error_is_one_line(tmp_path):
    out = _pretrain(tmp_path / "run", "data.text_shards=[/nonexistent/text-*.tar]")
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == ["error: data.text_shards: '/nonexistent/text-*.tar' matches no shard file; check the path, or "
                     "run launch/prepare_data.py to write shards"], out.stderr[-2000:]
    debug = _pretrain(tmp_path / "run", "data.text_shards=[/nonexistent/text-*.tar]", env={"FLASHTRAIN_DEBUG": "1"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr + debug.stdout


def test_an_unexpected_error_writes_the_elastic_error_file(tmp_path):
    err = tmp_path / "error.json"
    out = _pretrain(tmp_path / "run", "train.seed=abc", env={"TORCHELASTIC_ERROR_FILE": str(err)})
    assert out.returncode == 1
    report = json.loads(err.read_text())
    assert "invalid literal for int()" in report["message"]["message"]
    assert "Traceback" in report["message"]["extraInfo"]["py_callstack"]
