"""Loader throughput on the default corpus with the flash_small settings: a benchmark, not a test.

    python launch/bench_data.py [+exp=flash_small] [hydra overrides...] [--batches 200]

`+exp=NAME` and overrides choose the data settings (no override at all: +exp=flash_small, whose data is
the embedded default corpus); `--batches N`: the loader batches timed (default 200).

Prints wall-clock tokens/s and tokens per CPU second of this process (steadier on a shared machine;
with data.num_workers > 0 the workers' CPU time is not in it).
"""

from __future__ import annotations

import json
import sys
import time

from flashtrain.config.cli import exit_with_help  # noqa: E402 - imports nothing heavy

if __name__ == "__main__":
    exit_with_help(__doc__, sys.argv[1:])  # --help: this docstring, before the slow imports

from flashtrain.data.loader import PackedLoader, data_sources  # noqa: E402
from flashtrain.train.config import compose, data_config, model_config, token_spec  # noqa: E402


def main(argv: list[str]) -> int:
    batches = 200
    if "--batches" in argv:
        i = argv.index("--batches")
        batches, argv = int(argv[i + 1]), argv[:i] + argv[i + 2:]
    conf = compose(argv or ["+exp=flash_small"])
    dcfg, spec = data_config(conf), token_spec(model_config(conf))
    t0 = time.perf_counter()
    sources, _ = data_sources(dcfg, spec)
    t_build = time.perf_counter() - t0
    loader = PackedLoader(dcfg, spec, sources)
    next(loader)  # warm up (worker start)
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    per_source = [0] * len(sources)
    for _ in range(batches):
        b = next(loader)
        tokens += b["tokens"].numel()
        per_source = [n + int(v) for n, v in zip(per_source, b["stream_tokens"].sum(0))]
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    line, res = summary(batches, dcfg.batch_size, dcfg.seq_len, tokens, dt, cpu, t_build, sources, per_source,
                        loader.counters())
    print(line)
    print(json.dumps(res))
    return 0


def summary(batches: int, batch_size: int, seq_len: int, tokens: int, dt: float, cpu: float, t_build: float,
            sources, per_source: list[int], counters: dict) -> tuple[str, dict]:
    """The printed line and the JSON record: tokens/s by wall-clock (`dt`) and by this process's CPU time (`cpu`);
    each source with shards: its tokens, its share of all the sources' tokens and its weight's share of the
    weights (`per_source` in the order of `sources`); the padding fraction (the loader's pad tokens / tokens)."""
    weights = sum(s.weight for s in sources if s.shards)
    shares = {s.name: {"tokens": n, "share": n / max(sum(per_source), 1), "weight_share": s.weight / weights}
              for s, n in zip(sources, per_source) if s.shards}
    res = {"batches": batches, "batch_size": batch_size, "seq_len": seq_len, "tokens_per_s": tokens / dt,
           "tokens_per_cpu_s": tokens / cpu, "corpus_ready_s": t_build, "sources": shares,
           "padding_fraction": counters["pad_tokens"] / counters["tokens"], "counters": counters}
    line = (f"{tokens / dt:,.0f} tokens/s ({tokens / cpu:,.0f} per CPU second of this process; {batches} batches of "
            f"{batch_size} x {seq_len}); shares "
            + ", ".join(f"{k} {100 * v['share']:.1f}% (weight {100 * v['weight_share']:.1f}%)"
                        for k, v in shares.items())
            + f", padding {100 * res['padding_fraction']:.3f}%, corpus ready in {t_build:.1f} s")
    return line, res


if __name__ == "__main__":
    from flashtrain.config.cli import exit_on_user_error

    sys.exit(exit_on_user_error(main, sys.argv[1:]))
