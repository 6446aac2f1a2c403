"""I/O engines (io_uring, thread pool), aligned buffers, durable file helpers."""

from kvstore.io.buffers import AlignedBuffer, BufferPool
from kvstore.io.engine import IOEngine, IOQueue, make_engine, run_all

__all__ = ["AlignedBuffer", "BufferPool", "IOEngine", "IOQueue", "make_engine", "run_all"]
