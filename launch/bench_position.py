"""What the data position costs at the recipe's scale (data/loader.py; data/README.md "Resuming"): a cursor
per shard, saved in every checkpoint and carried with every batch, re-split over another layout at a resume.

    python launch/bench_position.py                     # a million shards, 32 readers, re-split to 1 and 256
    python launch/bench_position.py --shards 200000 --readers 8 --to 1 2 16

Prints, for --readers groups each owning its share of --shards shards of one source: the time of one
group's `state()` (taken after every batch), the bytes of one group's state and of all of them (what a
checkpoint holds), and the time `relayout` takes to re-split the whole position over each --to count of
groups (once, at a resume in another layout). Nothing is read from disk: the shards are names.
"""

from __future__ import annotations

import argparse
import io
import time

CAPACITY = 65537  # positions per packed row (a 64K sequence + 1), in the states and the re-split


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="launch/bench_position.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--shards", type=int, default=1_000_000, help="shards of the source (default 1,000,000)")
    ap.add_argument("--readers", type=int, default=32, help="reader groups that saved the position (default 32)")
    ap.add_argument("--to", type=int, nargs="+", default=[1, 256], help="groups to re-split over (default 1 256)")
    args = ap.parse_args(argv)
    import torch

    from flashtrain.data.loader import Counters, ShardStream, relayout
    from flashtrain.data.sources import default_sources

    names = [f"/data/web/web-{i:07d}.tar" for i in range(args.shards)]
    stream = ShardStream(names[0::args.readers], 0, "0/0", Counters())
    t = time.perf_counter()
    for _ in range(20):
        state = stream.state()
    per_batch = (time.perf_counter() - t) / 20
    buf = io.BytesIO()
    torch.save(state, buf)
    print(state_line(args.shards, args.readers, per_batch, buf.tell()))
    states = saved_states(args.shards, args.readers)
    sources = default_sources(names, [], [1, 0])[:1]
    for to in args.to:
        t = time.perf_counter()
        relayout(states, sources, to, CAPACITY, 0)
        print(f"re-split over {to} group(s): {time.perf_counter() - t:.2f} s (once, at a resume in another layout)")
    return 0


def state_line(shards: int, readers: int, per_batch_s: float, group_bytes: int) -> str:
    """The printed line: one group's `state()` time (ms), its saved bytes (MB) and a checkpoint's, which holds the
    state of every one of the `readers` groups."""
    return (f"{shards:,} shards over {readers} reader group(s): one group's state() {per_batch_s * 1e3:.3f} ms "
            f"(every batch), {group_bytes / 1e6:.2f} MB per group, {group_bytes * readers / 1e6:.1f} MB in a "
            f"checkpoint")


def saved_states(shards: int, readers: int) -> list[dict]:
    """The loader states a checkpoint of `readers` groups holds for one text source of `shards` shards: group g
    owns shards g, g + readers, ... (a cursor each, all at the start), one worker per group."""
    import numpy as np

    from flashtrain.data.loader import Counters

    def group(g: int) -> dict:
        n = len(range(g, shards, readers))
        return {"weights": {"text": 1}, "counters": Counters().as_dict(), "corrupt_shards_found": [],
                "sources": {"text": {"tag": 0, "shards_sha": None, "mix_tokens": 0, "pending": [], "buffer": [],
                                     "cursors": {"epoch": np.zeros(n, np.int32), "skip": np.zeros(n, np.int32)}}}}

    return [{"version": 3, "rank": r, "world": readers, "num_workers": 1, "capacity": CAPACITY, "next_worker": 0,
             "worker_states": {0: group(r)}} for r in range(readers)]


if __name__ == "__main__":
    raise SystemExit(main())
