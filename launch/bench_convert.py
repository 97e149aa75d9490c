"""Peak memory of launch/export_official.py and launch/import_official.py against the shard size: a
measurement, not a test (docs/official_formats.md).

    python launch/bench_convert.py [+exp=flash_small] [--shard-gb 0.05 0.2] [--dir /tmp/bench_convert]

Writes a synthetic flashtrain checkpoint of the exp's model (its initial weights), then for each shard size
exports it (FP8 / FP4 release formats, `--shard-gb S`) and imports the result (`--part-gb S`), each in its
own process, and prints each process's peak RSS next to the checkpoint's size and the RSS of a process
that only builds the model's shapes (the fixed cost). A bounded converter's peak minus that baseline
follows the shard size, not the checkpoint size.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PEAK = re.compile(r"peak RSS ([0-9.]+) GiB")
HEADER = (f"{'shard GiB':>10} {'export peak':>12} {'- baseline':>11} {'import peak':>12} {'- baseline':>11} "
          f"{'shards':>7}")


def _baseline(overrides: list[str]) -> float:
    """Peak RSS (GiB) of a process that imports the converter and builds the model's shapes."""
    code = ("from flashtrain.train.config import compose, model_config\n"
            "from flashtrain.train.official.convert import model_shapes\n"
            "from flashtrain.train.official.convert import peak_rss_gib\n"
            "model_shapes(model_config(compose(%r)))\n"
            "print(peak_rss_gib())") % (overrides,)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _write_checkpoint(overrides: list[str], path: Path) -> int:
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    from flashtrain.parallel.construct import model_template
    from flashtrain.train.checkpoint import _blob
    from flashtrain.train.config import compose, model_config

    conf = compose(overrides)
    cfg = model_config(conf)
    model = model_template(cfg).materialize("cpu", 0)
    state = model.state_dict()
    meta = {"step": 0, "tokens_seen": 0, "config": {"model": OmegaConf.to_container(conf.model, resolve=True)},
            "engram_compressed_vocab_size": cfg.engram_compressed_vocab_size or cfg.vocab_size}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.save({"model": state, "meta": _blob(meta)}, checkpoint_id=str(path))
    return sum(t.numel() * t.element_size() for t in state.values())


def _run(script: str, *args: str) -> float:
    out = subprocess.run([sys.executable, str(ROOT / "launch" / script), *args], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return float(PEAK.search(out.stdout).group(1))


def main(argv: list[str] | None = None) -> int:
    from flashtrain.config.cli import overrides_help

    ap = argparse.ArgumentParser(prog="launch/bench_convert.py", description=__doc__, allow_abbrev=False,
                                 epilog=overrides_help("Default: +exp=flash_small."),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shard-gb", type=float, nargs="+", default=[0.05, 0.2],
                    help="shard sizes (GiB) to export and import with, one pair of processes each (default 0.05 0.2)")
    ap.add_argument("--dir", default="/tmp/bench_convert",
                    help="work directory, emptied first (default /tmp/bench_convert)")
    args, overrides = ap.parse_known_args(argv)
    overrides = overrides or ["+exp=flash_small"]
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    total = _write_checkpoint(overrides, work / "ckpt")
    base = _baseline(overrides)
    print(f"{' '.join(overrides)}: checkpoint {total / 2**30:.3f} GiB (fp32); baseline process {base:.2f} GiB")
    print(HEADER)
    for s in args.shard_gb:
        out, back = work / f"off_{s}", work / f"imp_{s}"
        e = _run("export_official.py", str(work / "ckpt"), str(out), "--shard-gb", str(s))
        i = _run("import_official.py", str(out), str(back), *overrides, "--part-gb", str(s))
        print(row(s, e, i, base, len(list(out.glob("*.safetensors")))))
    return 0


def row(shard_gb: float, export_gib: float, import_gib: float, base_gib: float, shards: int) -> str:
    """One line of the table: the export's and the import's peak RSS (GiB), each also less the baseline
    process's (the part that should follow the shard size), and the shards the export wrote."""
    return (f"{shard_gb:>10.3f} {export_gib:>11.2f}G {export_gib - base_gib:>10.2f}G {import_gib:>11.2f}G "
            f"{import_gib - base_gib:>10.2f}G {shards:>7}")


if __name__ == "__main__":
    from flashtrain.config.cli import exit_on_user_error

    raise SystemExit(exit_on_user_error(main))
