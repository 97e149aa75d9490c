"""One rank of the two-process job of tests/test_nodes.py's lost-peer test (not collected: no test_ prefix).

    python tests/liveness_job.py RANK PORT PEER_TIMEOUT_S

Both ranks join a gloo process group (rank 0 hosts the store at 127.0.0.1:PORT) and start their heartbeats
(parallel/liveness.py); rank 1 then freezes itself (SIGSTOP: its sockets stay open, so gloo never fails, as
NCCL waits for a dead peer) while rank 0 waits for it in a barrier that only the process group's timeout
(600 s) would end. Rank 0's watch must end it within PEER_TIMEOUT_S, naming rank 1."""

import datetime
import os
import signal
import sys
import time

import torch.distributed as dist

from flashtrain.parallel.liveness import Liveness

rank, port, peer_timeout_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
live = Liveness.for_job(rank, 2, peer_timeout_s, lambda ranks: f"the ranks {sorted(ranks)}")
dist.barrier()
print(f"rank {rank} beating at {time.time():.3f}", flush=True)
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
dist.barrier()
print(f"rank {rank} passed the second barrier", flush=True)
