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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="launch/bench_position.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--shards", type=int, default=1_000_000, help="shards of the source (default 1,000,000)")
    ap.add_argument("--readers", type=int, default=32, help="reader groups that saved the position (default 32)")
    ap.add_argument("--to", type=int, nargs="+", default=[1, 256], help="groups to re-split over (default 1 256)")
    args = ap.parse_args(argv)
    import numpy as np
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
    print(f"{args.shards:,} shards over {args.readers} reader group(s): one group's state() {per_batch * 1e3:.3f} ms "
          f"(every batch), {buf.tell() / 1e6:.2f} MB per group, {buf.tell() * args.readers / 1e6:.1f} MB in a "
          f"checkpoint")

    def group(g: int) -> dict:
        n = len(range(g, args.shards, args.readers))
        return {"weights": {"text": 1}, "counters": Counters().as_dict(), "corrupt_shards_found": [],
                "sources": {"text": {"tag": 0, "shards_sha": None, "mix_tokens": 0, "pending": [], "buffer": [],
                                     "cursors": {"epoch": np.zeros(n, np.int32), "skip": np.zeros(n, np.int32)}}}}

    states = [{"version": 3, "rank": r, "world": args.readers, "num_workers": 1, "capacity": 65537, "next_worker": 0,
               "worker_states": {0: group(r)}} for r in range(args.readers)]
    sources = default_sources(names, [], [1, 0])[:1]
    for to in args.to:
        t = time.perf_counter()
        relayout(states, sources, to, 65537, 0)
        print(f"re-split over {to} group(s): {time.perf_counter() - t:.2f} s (once, at a resume in another layout)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
