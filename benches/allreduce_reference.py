"""The reference for benches/allreduce.rs: the same all-reduces (sum, f32, out of place) through
mpi4py on numpy buffers, timed the same way (warm-up, barrier, the slowest rank's mean time).

    pip install mpi4py numpy
    mpirun -np 2 python3 benches/allreduce_reference.py
"""

import os
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
max_bytes = int(os.environ.get("ALLREDUCE_MAX_BYTES", 256 << 20))
if rank == 0:
    print(f"# mpi4py Allreduce (sum, f32, out of place) over {world} ranks")
    print(f"{'bytes':>12} {'iters':>8} {'time (us)':>12} {'busbw (GB/s)':>12}")
size = 1024
while size <= max_bytes:
    send = np.ones(size // 4, dtype=np.float32)
    iters = min(max((64 << 20) // size, 5), 2000)
    for _ in range(3):
        recv = np.empty_like(send)  # a fresh output per call, as ndscope's all_reduce returns one
        comm.Allreduce(send, recv, op=MPI.SUM)
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        recv = np.empty_like(send)
        comm.Allreduce(send, recv, op=MPI.SUM)
    mine = (time.perf_counter() - start) / iters
    seconds = comm.allreduce(mine, op=MPI.MAX)
    busbw = size / seconds * 2 * (world - 1) / world / 1e9
    if rank == 0:
        print(f"{size:>12} {iters:>8} {seconds * 1e6:>12.2f} {busbw:>12.3f}")
    size *= 4
