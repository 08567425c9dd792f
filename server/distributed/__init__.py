"""Tensor parallelism on torch.distributed (gloo on CPU, NCCL on CUDA).

Rank 0 is the server process: it owns the scheduler, the block manager and the HTTP API, and broadcasts
each step's `SchedulerOutput` (plain Python) to ranks 1..N-1 (`worker.py`), started by `driver.py`.
Every rank runs its Megatron-style shard of the model (`sharding.py`); only rank 0 samples.
"""
