"""launch/pretrain.py's torchrun conventions (issue 17 item 6): a configuration or input error is one line
naming the value and the fix, exit status 2, no traceback; an unexpected error goes through
torch.distributed.elastic's `record`, which writes the rank's error file; Hydra's job log receives the
trainer's log lines."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import warm_launch

ROOT = Path(__file__).resolve().parent.parent


def _pretrain(run_dir, *overrides, env=None):
    return warm_launch.run([sys.executable, str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny",
                             f"hydra.run.dir={run_dir}", "logging.wandb.mode=disabled", *overrides],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_a_plain_start_answers_hydras_mode_probe_itself(monkeypatch, tmp_path):
    """A plain start (overrides only) answers Hydra's mode probe itself -- a single run: None, which Hydra runs
    as RUN, as its own probe finds with conf/'s unset hydra.mode -- instead of composing the whole config a
    third time; with Hydra's flags (-m) or a hydra.mode override Hydra probes as usual."""
    import importlib.util

    from hydra._internal.hydra import Hydra

    spec = importlib.util.spec_from_file_location("pretrain_entry", ROOT / "launch" / "pretrain.py")
    pretrain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain)
    probe = Hydra.get_mode
    monkeypatch.setattr(pretrain, "hydra_main", lambda: None)
    for argv, probed in ((["hydra.mode=RUN"], True), (["++hydra.mode=RUN"], True), (["-m"], True),
                         ([], False)):  # the plain start last
        monkeypatch.setattr(Hydra, "get_mode", probe)
        monkeypatch.setattr(sys, "argv", ["pretrain.py", "+exp=flash_tiny", f"hydra.run.dir={tmp_path}", *argv])
        pretrain.main()
        assert (Hydra.get_mode is probe) == probed, argv
    assert Hydra.get_mode(None, "config", ["+exp=flash_tiny"]) is None  # the answer (after the plain start above)
    # what Hydra's own probe reads: hydra.mode of the composed config, which conf/ leaves unset
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from flashtrain.config import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        assert hydra_compose(config_name="config", overrides=["+exp=flash_tiny"], return_hydra_config=True
                             ).hydra.mode is None


@pytest.mark.slow
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


# --- issue 30 item 12: every configuration or input mistake is one line, exit 2, before anything is built ----
NOT_A_TAR = "not-a-tar.tar"
MISTAKES = {  # id: (overrides, what the line must say)
    "no shards": (["data.text_shards=[]", "data.mm_shards=[]"], "data.text_shards and data.mm_shards are both empty"),
    "unknown top-level key": (["+foo=bar"], "+foo=bar: 'foo' is not a config group or key; the top-level keys are"),
    "typo'd group": (["+trian.max_steps=3"], "'trian' is not a config group or key (did you mean 'train'?)"),
    "unknown key without +": (["train.max_step=3"], "train.max_step=3: train has no key 'max_step' (did you mean "
                                                     "train.max_steps?)"),
    "unknown exp": (["+exp=flash_smal"], "+exp=flash_smal: there is no exp 'flash_smal' (did you mean "
                                         "+exp=flash_small?)"),
    "too many workers": (["data.num_workers=17"], "data.num_workers=17: data.corpus_shards has 16 shard(s), which "
                                                  "cannot feed 1 data-parallel rank(s) x 17 worker(s)"),
    "not a tar": ([f"data.text_shards=[{{tmp}}/{NOT_A_TAR}]", "data.mm_shards=null"],
                  f"data.text_shards: none of its 1 shard(s) can be read ('{{tmp}}/{NOT_A_TAR}': not a tar file"),
    "missing tokenizer": (["data.tokenizer=/nonexistent.json"], "data.tokenizer='/nonexistent.json' does not exist"),
    "nothing to resume from": (["train.resume_from=/nonexistent/step_00000001"],
                               "train.resume_from='/nonexistent/step_00000001' does not exist"),
    "no held-out shards": (["train.eval.interval=2", "data.val_shards=[/nonexistent/val-*.tar]"],
                           "data.val_shards: '/nonexistent/val-*.tar' matches no shard file"),
    "shards of another exp": (["data.text_shards=[{tmp}/other/text-*.tar]", "data.mm_shards=null"],
                              "the tokenizer beside the shards {tmp}/other/tokenizer.json does not fit this run's "
                              "model (640 ids, the model has model.vocab_size=512): the shards were written with "
                              "launch/prepare_data.py +exp=flash_small;"),
}
BUILT = "process(es) on"  # the trainer's log line once the process group exists


def _error_line(out, want):
    """The one `error:` line on stderr, which says `want`; nothing was built, and no rank printed a traceback."""
    text = out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and want in errors[0], text[-3000:]
    assert BUILT not in text, text[-3000:]
    return errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MISTAKES))
def test_a_mistake_is_one_line_and_exit_2(tmp_path, case):
    """... and a refused start writes nothing (issue 47 item 2): not even the run directory Hydra made."""
    (tmp_path / NOT_A_TAR).write_text("plain text, not a tar archive\n")
    if case == "shards of another exp":
        _other_exp_shards(tmp_path / "other")
    overrides, want = MISTAKES[case]
    out = _pretrain(tmp_path / "run", *[o.format(tmp=tmp_path) for o in overrides])
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
    line = _error_line(out, want.format(tmp=tmp_path))
    assert [x for x in out.stderr.splitlines() if x.strip()] == [line]  # no Hydra text, warning or traceback
    assert "Traceback" not in out.stdout
    assert not (tmp_path / "run").exists()


def _other_exp_shards(folder: Path) -> None:
    """Shards as launch/prepare_data.py writes them for another exp: a 640-id tokenizer, its manifest record."""
    import numpy as np

    from flashtrain.data.config import TokenSpec
    from flashtrain.data.shards import Document, write_shards
    from flashtrain.data.tokenizer import train_tokenizer

    write_shards(iter([Document([("text", np.arange(3, 90, dtype=np.int32))])] * 4), folder, "text", 1)
    train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, TokenSpec(640, image_token_id=600)).save(
        str(folder / "tokenizer.json"))
    (folder / "manifest.json").write_text(json.dumps({"tokenizer": "tokenizer.json", "written_for": {
        "overrides": ["+exp=flash_small"], "model": "flash_small", "vocab_size": 640}}))


def test_the_other_launch_tools_share_the_one_line_exit():
    """launch/plan.py goes through the same helper (flashtrain.config.errors.exit_on_user_error) and compose."""
    out = warm_launch.run([sys.executable, str(ROOT / "launch" / "plan.py"), "+exp=flash_smal"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and [line for line in out.stderr.splitlines() if line.strip()] == [
        "error: +exp=flash_smal: there is no exp 'flash_smal' (did you mean +exp=flash_small?); the exp options are "
        "flash, flash_2048gpu, flash_2048gpu_1m, flash_dspark, flash_node, flash_small, flash_small_dspark, "
        "flash_tiny, flash_tiny_dspark (conf/exp/*.yaml)"], out.stderr
    out = warm_launch.run([sys.executable, str(ROOT / "launch" / "evaluate.py"), "/nonexistent/step_00000001"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and [line for line in out.stderr.splitlines() if line.strip()] == [
        "error: '/nonexistent/step_00000001' is not a checkpoint (no .metadata); give a checkpoints/step_XXXXXXXX "
        "directory or one written by launch/import_official.py"], out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unknown exp"])
def test_under_torchrun_a_mistake_is_printed_once(tmp_path, case):
    """Two workers: rank 0 prints the line, rank 1 stays silent, both exit 2 before a process group exists
    (one mistake: every kind goes through the same helper, conf/cli.py, checked one by one above).
    torchrun itself exits 1 (it turns every failed worker into status 1) after its ChildFailedError report,
    whose root cause is local rank 0 with exitcode 2 -- the one place its report can say what kind of
    failure it was."""
    overrides, want = MISTAKES[case]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "launch" / "pretrain.py"), "+exp=flash_tiny", f"hydra.run.dir={tmp_path / 'run'}",
           "logging.wandb.mode=disabled", *overrides]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    _error_line(out, want)
    assert text.count("Traceback") == 1 and "ChildFailedError" in text, text[-3000:]  # torchrun's report only
    root = text[text.index("Root Cause"):]
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)\s+exitcode\s+: 2 ", root), root
