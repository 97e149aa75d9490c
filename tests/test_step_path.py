"""docs/step_path.md kept true: the files a steady-state flash_tiny step enters, traced with `sys.setprofile`,
against the table of every file one step enters (issue 51 item 5)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from layer_plans import FOUR_LAYERS

from flashtrain.train.config import compose
from flashtrain.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "step_path.md"
AS_THE_DATA_NEEDS = "*as the data needs*"


def documented() -> tuple[dict[str, str], int]:
    """{file: its row's description} of the section "Every file one step enters", and the count its text states."""
    section = DOC.read_text().split("## Every file one step enters", 1)[1]
    rows = dict(re.findall(r"^\| `([^`]+)` \| (.+) \|$", section, re.M))
    stated = int(re.search(r"(\d+) files", section)[1])
    return rows, stated


def entered(step) -> set[str]:
    """The project files (not tests/) whose code runs while `step()` runs, in this thread."""
    seen: set[str] = set()
    root = str(ROOT) + "/"

    def profile(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(root) and not f.startswith(root + "tests/"):
                seen.add(f[len(root):])

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return seen


def test_step_path_lists_every_file_a_step_enters(tmp_path):
    cfg = compose(["+exp=flash_tiny", *FOUR_LAYERS, f"data.corpus_dir={tmp_path / 'corpus'}",
                   "data.corpus_text_bytes=300000", "data.corpus_mm_docs=100", "data.corpus_shards=2",
                   "train.global_batch_tokens=512", "data.batch_size=1", "logging.wandb.mode=disabled",
                   "logging.progress=false", "run_name=step_path", "train.max_steps=4"])
    t = Trainer(cfg, tmp_path / "run")
    try:
        t.module.guard.start(t.step, t.tokens_seen)
        t.train_step()  # the first step: optimizer state, cached FLOPs (not the steady state)
        steps = [entered(t.train_step) for _ in range(2)]
    finally:
        t.run.release()
        t.loader.close()
    rows, stated = documented()
    always = {f for f, what in rows.items() if AS_THE_DATA_NEEDS not in what}
    assert len(rows) == stated, f"the section says {stated} files, its table lists {len(rows)}"
    assert all((ROOT / f).is_file() for f in rows), [f for f in rows if not (ROOT / f).is_file()]
    undocumented = set().union(*steps) - set(rows)
    assert not undocumented, f"a step enters files docs/step_path.md does not list: {sorted(undocumented)}"
    for seen in steps:
        assert always <= seen, f"docs/step_path.md lists files a step does not enter: {sorted(always - seen)}"
