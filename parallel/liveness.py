"""Which ranks are still there: heartbeats through the job's store (issue 49 item 3; docs/parallelism.md
"Many nodes", "The loss of a node").

Every rank of a torchrun job runs a `Liveness` thread that adds 1 to its counter in the job's store
(torchrun's TCPStore at MASTER_ADDR:MASTER_PORT, the one the process group was made with) every
`beat_s` = min(`parallel.peer_timeout_s` / BEATS_PER_TIMEOUT, MAX_BEAT_S). A counter that moves says the process and its
node are there, not that the rank makes progress: a rank stuck inside a long step still beats, and
`parallel.timeout_s` (the process group's timeout) bounds that.

- A collective that fails (gloo: the connection to a dead peer closes at once) is explained by
  `lost_ranks`: every counter read twice, POST_MORTEM_BEATS beats apart; those that did not move are the
  lost ranks, named with their nodes (parallel/nodes.py `NodeTable`) in the job's one-line error.
- A peer that is gone while the others wait in a collective that never fails by itself (NCCL waits for a
  dead peer until `parallel.timeout_s`, 30 minutes by default): rank 0's thread watches every counter; one
  that has not moved for `parallel.peer_timeout_s` ends the job: rank 0 prints the one line, writes it to
  the store as the job's verdict and exits; every other rank's thread finds the verdict at its next beat
  and exits too. A rank whose store does not answer for `parallel.peer_timeout_s` (the node hosting it,
  the rendezvous endpoint, is gone) exits by itself. So no rank outlives a lost node by more than
  peer_timeout_s + 2 beats, whatever the backend.

The exit is `os._exit` from the thread, after the line: the main thread may be blocked in a collective
that never returns. Checkpoints are written to a temporary directory and renamed when complete, so an
exit at any moment leaves the newest complete checkpoint intact.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time

import torch.distributed as dist

from flashtrain.config.errors import EXIT_USER_ERROR

log = logging.getLogger(__name__)

BEATS_PER_TIMEOUT = 6  # beats within parallel.peer_timeout_s
MAX_BEAT_S = 2.0  # and at least one every 2 s: the post-mortem of a failed collective waits 3 beats
POST_MORTEM_BEATS = 2  # a counter that has not moved over this many beats (plus one, for the reads) is lost


def _namespace() -> str:
    """The keys of this attempt of this job (a torchrun restart starts a new attempt in the same store)."""
    return (f"flashtrain/liveness/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")


def _die(line: str | None) -> None:
    if line is not None:
        sys.stdout.flush()
        print(f"error: {line}", file=sys.stderr, flush=True)
    os._exit(EXIT_USER_ERROR)


class Liveness:
    """The heartbeat of one rank, its watch over the others (rank 0) and the post-mortem of a failed
    collective (module docstring). `describe(ranks)` names ranks and their nodes in messages."""

    def __init__(self, store, rank: int, world: int, peer_timeout_s: float, describe=None):
        self.store, self.rank, self.world = store, rank, world
        self.peer_timeout_s = float(peer_timeout_s)
        self.beat_s = min(self.peer_timeout_s / BEATS_PER_TIMEOUT, MAX_BEAT_S)
        self.describe = describe or (lambda ranks: "ranks " + ",".join(map(str, sorted(ranks))))
        self.prefix = _namespace()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._moved = [time.monotonic()] * world  # rank 0's watch: when each counter last moved
        self._seen = [-1] * world

    @classmethod
    def for_job(cls, rank: int, world: int, peer_timeout_s: float, describe=None) -> Liveness | None:
        """A started `Liveness` for a torchrun job of more than one process (its own connection to the job's
        store); None otherwise."""
        if world == 1 or not dist.is_initialized() or "MASTER_ADDR" not in os.environ:
            return None
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=peer_timeout_s), wait_for_workers=False)
        me = cls(store, rank, world, peer_timeout_s, describe)
        me.start()
        return me

    def key(self, rank: int) -> str:
        return f"{self.prefix}beat/{rank}"

    @property
    def verdict_key(self) -> str:
        return f"{self.prefix}verdict"

    def beat(self) -> None:
        self.store.add(self.key(self.rank), 1)

    def counters(self) -> list[int]:
        """Every rank's heartbeat count (0: never beat); raises when the store does not answer."""
        return [int(self.store.add(self.key(r), 0)) for r in range(self.world)]

    def start(self) -> None:
        self.beat()  # counted before the first collective of the loop
        self._thread = threading.Thread(target=self._run, name="flashtrain-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.beat_s + 5)

    # -------------------------------------------------------------------------------- the post-mortem
    def lost_ranks(self) -> list[int] | None:
        """The ranks whose heartbeat does not move (this rank's own thread keeps beating meanwhile); None when
        the store itself does not answer."""
        try:
            before = self.counters()
            time.sleep(self.beat_s * (POST_MORTEM_BEATS + 1))
            after = self.counters()
        except Exception:  # noqa: BLE001 - DistNetworkError, DistStoreError, RuntimeError: the store is gone
            return None
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    # -------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        unanswered_since = None
        while not self._stop.wait(self.beat_s):
            try:
                self.beat()
                if self.rank == 0:
                    self._watch(self.counters())
                elif self.store.check([self.verdict_key]):
                    _die(None)  # rank 0 printed the verdict
                unanswered_since = None
            except Exception:  # noqa: BLE001 - the store does not answer
                now = time.monotonic()
                unanswered_since = unanswered_since or now
                if now - unanswered_since >= self.peer_timeout_s and not self._stop.is_set():
                    _die(self.store_gone_line())

    def _watch(self, counts: list[int]) -> None:
        """Rank 0: end the job when a counter has not moved for peer_timeout_s."""
        now = time.monotonic()
        for r, c in enumerate(counts):
            if c != self._seen[r]:
                self._seen[r], self._moved[r] = c, now
        lost = [r for r in range(self.world) if now - self._moved[r] >= self.peer_timeout_s]
        if lost and not self._stop.is_set():
            line = self.lost_line(lost, f"its heartbeat has not moved for parallel.peer_timeout_s="
                                        f"{self.peer_timeout_s:g} s")
            try:
                self.store.set(self.verdict_key, line)
            except Exception:  # noqa: BLE001 - the others then find the store gone
                pass
            _die(line)

    def lost_line(self, lost: list[int], how: str, named: bool = True) -> str:
        """The one line of a lost peer (`named`: starting with this rank, when it is the whole message)."""
        who = f"rank {self.rank}: " if named else ""
        return (f"{who}{self.describe(lost)} is gone ({how}: the process or its node died); the last "
                f"checkpoint is intact -- start every node again to resume, or the remaining nodes alone (the "
                f"data position re-splits over fewer readers)")

    def store_gone_line(self, waited: bool = True, named: bool = True) -> str:
        """The one line of a store that does not answer: after peer_timeout_s of the thread's tries (`waited`),
        or at once in a post-mortem."""
        who = f"rank {self.rank}: " if named else ""
        how = (f"has not answered for parallel.peer_timeout_s={self.peer_timeout_s:g} s" if waited else
               "does not answer")
        return (f"{who}the job's store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} {how}: "
                f"the node that hosts it (the rendezvous endpoint) is gone; the last checkpoint is intact -- start "
                f"every node again to resume")
