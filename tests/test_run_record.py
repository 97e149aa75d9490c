"""What a start writes into its run directory, and when (issue 47 item 2, train/runtime/run_record.py): nothing until
it is admitted; then the config record (.hydra/) and the job log with the start-up lines it held; a refused
start removes the directories it created and leaves an existing directory as it was."""

import logging

from omegaconf import OmegaConf

from flashtrain.config import CONF_DIR
from flashtrain.train.runtime.run_guard import LOCK_NAME, acquire_run_lock
from flashtrain.train.runtime.run_record import StartRecord, new_directories


def _hydra(run_dir):
    return OmegaConf.create({"runtime": {"output_dir": str(run_dir)}, "job": {"name": "pretrain"},
                             "overrides": {"task": ["+exp=flash_tiny", "train.max_steps=3"]},
                             "job_logging": OmegaConf.load(CONF_DIR / "hydra" / "job_logging" / "console.yaml")})


def test_an_admitted_start_records_its_config_and_the_lines_it_held(tmp_path):
    run = tmp_path / "runs" / "tiny"
    created = new_directories(run)
    assert created == [run, tmp_path / "runs"]  # deepest first, up to what exists
    run.mkdir(parents=True)  # what Hydra does before the task runs
    log = logging.getLogger("flashtrain.test_run_record")
    start = StartRecord(_hydra(run), OmegaConf.create({"train": {"max_steps": 3}}), created)
    log.warning("a start-up line")
    assert sorted(p.name for p in run.iterdir()) == []  # held, not written
    start.admit(is_main=True)
    log.warning("a line after admission")
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for h in handlers:
        h.flush()
    try:
        lines = (run / "pretrain.log").read_text().splitlines()
        assert [line.split("] - ", 1)[1] for line in lines] == ["a start-up line", "a line after admission"]
        assert lines[0].endswith("][flashtrain.test_run_record][WARNING] - a start-up line")  # the console's format
        assert (run / ".hydra" / "overrides.yaml").read_text() == "- +exp=flash_tiny\n- train.max_steps=3\n"
        assert (run / ".hydra" / "config.yaml").read_text() == "train:\n  max_steps: 3\n"
        assert "job:\n    name: pretrain\n" in (run / ".hydra" / "hydra.yaml").read_text()
    finally:
        for h in handlers:
            logging.getLogger().removeHandler(h)
            h.close()


def test_a_refused_start_leaves_nothing_behind(tmp_path):
    fresh = tmp_path / "a" / "b"
    created = new_directories(fresh)
    fresh.mkdir(parents=True)
    start = StartRecord(_hydra(fresh), OmegaConf.create({}), created)
    acquire_run_lock(fresh).close()  # the job lock a fresh directory received before a later check failed
    logging.getLogger("flashtrain.test_run_record").warning("held")
    start.refuse()
    assert list(tmp_path.iterdir()) == []  # the lock, b and a: gone
    assert start.held not in logging.getLogger().handlers and start.held.records == []

    busy = tmp_path / "busy"  # an existing directory (a running job's): left exactly as it was
    (busy / ".hydra").mkdir(parents=True)
    (busy / ".hydra" / "config.yaml").write_text("the running job's\n")
    (busy / LOCK_NAME).write_text("root, pid 1\n")
    start = StartRecord(_hydra(busy), OmegaConf.create({}), new_directories(busy))
    start.refuse()
    assert sorted(p.relative_to(busy).as_posix() for p in busy.rglob("*")) == [".hydra", ".hydra/config.yaml",
                                                                              LOCK_NAME]
    assert (busy / LOCK_NAME).read_text() == "root, pid 1\n"
