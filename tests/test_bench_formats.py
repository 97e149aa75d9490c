"""docs/formats/formats.png (launch/bench_formats.py): drawn from formats.json alone (`--replot`), its title
inside the picture, the right panel's curves each variant's moving average against plain's in % (by hand)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from flashtrain.config.errors import DataError

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_formats", ROOT / "launch" / "bench_formats.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

LONG = ["+exp=flash_small", *bench.EIGHT_LAYERS, "data.batch_size=1", "train.global_batch_tokens=512",
        "schedule.total_tokens=153600", "train.eval.tokens=8192"]


def result(curves):
    return {"overrides": LONG, "steps": 3, "tokens_per_step": 512, "device": "cpu (fp32)", "curves": curves}


def test_the_picture_is_drawn_from_the_json_with_its_title_inside_and_percent_against_plain(tmp_path):
    # moving averages over the first 3 steps (SMOOTH = 10: the running mean): plain 2, 3, 8/3; qat 2.2, 3.1, 8/3
    # -> qat against plain: +10%, +3.33%, 0%
    curves = {"plain": {"step": [1, 2, 3], "loss": [2.0, 4.0, 2.0]},
              "qat": {"step": [1, 2, 3], "loss": [2.2, 4.0, 1.8]}}
    fig = bench.formats_figure(result(curves))
    left, right = fig.axes
    assert "%" in right.get_ylabel() and "moving average" in left.get_ylabel()
    plain, qat = right.get_lines()
    np.testing.assert_allclose(plain.get_ydata(), [0.0, 0.0, 0.0], atol=1e-12)
    np.testing.assert_allclose(qat.get_ydata(), [10.0, 100 / 30, 0.0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(left.get_lines()[1].get_ydata(), [2.2, 3.1, 8 / 3], rtol=1e-12)
    title = fig._suptitle.get_text()
    assert title.replace("\n", " ") == bench.figure_title(result(curves))
    assert len(title.splitlines()) > 1 and all(len(line) <= bench.TITLE_CHARS for line in title.splitlines())
    fig.canvas.draw()
    box, page = fig._suptitle.get_window_extent(), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1  # not cut
    right_label = right.yaxis.label.get_window_extent()
    assert right_label.y1 <= box.y0 and right_label.y0 >= page.y0  # the y label stays below the title

    (tmp_path / "formats.json").write_text(json.dumps(result(curves)))
    assert bench.main(["--replot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "formats.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replot_names_a_json_without_curves(tmp_path):
    (tmp_path / "formats.json").write_text(json.dumps({"overrides": LONG, "steps": 3}))
    with pytest.raises(DataError, match=r"formats\.json has no curves / tokens_per_step.*run launch/bench_formats"):
        bench.replot(tmp_path)
