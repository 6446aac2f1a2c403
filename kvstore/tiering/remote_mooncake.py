"""The remote tier on Mooncake Store (``remote_backend="mooncake"``).

docs/integrations.md, "Beyond one machine". A client of a Mooncake Store cluster
(``mooncake-transfer-engine-non-cuda`` 0.3.13.post1, the ``kvstore[cluster]`` extra):
``MooncakeDistributedStore`` set up with ``metadata_server="P2PHANDSHAKE"`` (no etcd),
``protocol="tcp"`` and the master's address. Each node lends ``segment_bytes`` of its
memory to the cluster's pool. Reads and writes are zero-copy: the tier manager's DRAM
arena and its header blocks are registered once, and a value moves scattered into
(or gathered from) its header block and its DRAM slot
(``batch_get_into_multi_buffers`` / ``batch_put_from_multi_buffers``). A read goes
straight into a page's whole DRAM slot (``read_into``); only a value smaller than its
slot (Mooncake scatters into parts of exactly the value's size) costs a size query
(``batch_get_replica_desc``) and a second read.

Reads through the transfer engine (``reader="engine"``, the default): Mooncake's own
gets wait for their transfers by polling in a loop on the calling thread (the wheels
are built without ``USE_EVENT_DRIVEN_COMPLETION``), so a get burns a CPU for as long as
the bytes take, beside the threads that move them. The backend instead asks the master
where each value lies (``batch_get_replica_desc``: address, size, holder) and reads it
with a ``mooncake.engine.TransferEngine`` of its own, asynchronously, piece by piece
into the same header block and DRAM slot, and waits by sleeping between status checks
(docs/benchmarks.md, "Remote tier"), telling the caller of each value as it lands (the
tier verifies it then, while the rest are on their way). The read returns only when
every piece has finished or failed: a transfer still running can land in no slot given
to another page. Where that engine cannot start, the backend reads with the client's
gets (``reader="get"``), and says so in ``describe()``.

Options (``TierConfig.remote_options``): ``master`` ("host:port", required),
``hostname`` (this node's address as peers reach it, default 127.0.0.1),
``segment_bytes`` (memory lent to the pool, default 256 MiB), ``buffer_bytes``
(the client's own transfer buffer, default 16 MiB), ``protocol`` ("tcp"),
``metadata_server`` ("P2PHANDSHAKE"), ``device`` (RDMA devices, ""), ``prefer_local``
(true: a node publishes into the memory it lends), ``reader`` ("engine" or "get").
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvstore.tiering.remote import (
    Part,
    RemoteBackend,
    RemoteError,
    cut_parts,
    register_remote_backend,
)

__all__ = ["MOONCAKE_PACKAGE", "MooncakeBackend", "mooncake_available", "reason_of"]

MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"

# Mooncake's error codes (mooncake-store/include/types.h) -> the tier's reason words.
_OBJECT_NOT_FOUND = -704
_BUFFER_OVERFLOW = -600
_TRANSFER_FAIL = -800
_RPC_FAIL = -900

READERS = ("engine", "get")
# A transfer engine read's status checks: first this often, then less often while it
# lasts (a hung peer's read is polled until it ends, as a get would block until then).
_POLL_S = (0.0003, 0.002, 0.01)
_POLL_SLOWER_AFTER_S = (0.1, 1.0)


def reason_of(code: int) -> str:
    """The reason word of a negative Mooncake result."""
    if code == _OBJECT_NOT_FOUND:
        return "absent"
    if code == _BUFFER_OVERFLOW:
        return "too_large"
    if -899 <= code <= _TRANSFER_FAIL:
        return "transfer"
    if -999 <= code <= _RPC_FAIL:
        return "master"
    return "error"


def mooncake_available() -> str | None:
    """None when Mooncake's client imports, else why not (tests skip with it)."""
    try:
        import mooncake.store  # noqa: F401
    except Exception as e:
        return f"Mooncake Store's client is not installed ({MOONCAKE_PACKAGE}): {e}"
    return None


@register_remote_backend("mooncake")
class MooncakeBackend(RemoteBackend):
    """A Mooncake Store client; see the module docstring for its options."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        master = self.options.get("master")
        if not isinstance(master, str) or ":" not in master:
            raise ValueError(
                "remote_options['master'] must be the Mooncake master's 'host:port', "
                f"got {master!r}"
            )
        self.master = master
        self.hostname = str(self.options.get("hostname", "127.0.0.1"))
        self.segment_bytes = int(self.options.get("segment_bytes", 256 << 20))
        self.buffer_bytes = int(self.options.get("buffer_bytes", 16 << 20))
        self.protocol = str(self.options.get("protocol", "tcp"))
        self.metadata_server = str(self.options.get("metadata_server", "P2PHANDSHAKE"))
        self.device = str(self.options.get("device", ""))
        # A node's pages go into the memory it lends (then a node's loss loses its own
        # pages only); False: wherever the master places them.
        self.prefer_local = bool(self.options.get("prefer_local", True))
        self.reader = str(self.options.get("reader", "engine"))
        if self.reader not in READERS:
            raise ValueError(
                f"remote_options['reader'] must be one of {', '.join(READERS)}, got {self.reader!r}"
            )
        self._engine: Any = None  # the TransferEngine reads go through (reader="engine")
        self.engine_error: str | None = None  # why reads fell back to gets, if they did
        self._client: Any = None
        self._replicate: Any = None
        self._registered: list[tuple[int, int]] = []
        # Mooncake logs through glog to stderr: errors only, unless the operator said.
        os.environ.setdefault("GLOG_minloglevel", "2")

    @property
    def client(self) -> Any:
        """The ``MooncakeDistributedStore`` (None before ``connect``)."""
        return self._client

    def connect(self) -> None:
        reason = mooncake_available()
        if reason is not None:
            raise RemoteError(reason)
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        rc = client.setup(
            self.hostname,
            self.metadata_server,
            self.segment_bytes,
            self.buffer_bytes,
            self.protocol,
            self.device,
            self.master,
        )
        if rc != 0:
            raise RemoteError(f"cannot join the Mooncake cluster at {self.master} (setup: {rc})")
        for address, nbytes in self._registered:
            rc = client.register_buffer(address, nbytes)
            if rc != 0:
                client.close()
                raise RemoteError(f"register_buffer of {nbytes} bytes failed ({rc})")
        from mooncake.store import ReplicateConfig

        replicate = ReplicateConfig()
        if self.prefer_local:
            replicate.preferred_segment = client.get_hostname()
        self._replicate = replicate
        old, self._client = self._client, client
        if old is not None:
            old.close()
        if self.reader == "engine" and self._engine is None and self.engine_error is None:
            self._start_engine()

    def _start_engine(self) -> None:
        """The transfer engine the reads go through; on any failure, gets instead."""
        try:
            from mooncake.engine import TransferEngine

            engine = TransferEngine()
            rc = engine.initialize(self.hostname, self.metadata_server, self.protocol, self.device)
            if rc != 0:
                raise RemoteError(f"initialize: {rc}")
            for address, nbytes in self._registered:
                rc = engine.register_memory(address, nbytes)
                if rc != 0:
                    raise RemoteError(f"register_memory of {nbytes} bytes: {rc}")
        except Exception as e:
            self.engine_error = f"{type(e).__name__}: {e}"
            return
        self._engine = engine

    def register(self, address: int, nbytes: int) -> None:
        self._registered.append((address, nbytes))
        if self._client is not None:
            rc = self._client.register_buffer(address, nbytes)
            if rc != 0:
                raise RemoteError(f"register_buffer of {nbytes} bytes failed ({rc})")
        if self._engine is not None and self._engine.register_memory(address, nbytes) != 0:
            self._engine = None
            self.engine_error = f"register_memory of {nbytes} bytes failed"

    def _live(self) -> Any:
        if self._client is None:
            raise RemoteError("not connected to the Mooncake master")
        return self._client

    def sizes(self, keys: Sequence[str]) -> list[int | None]:
        client = self._live()
        found = client.batch_get_replica_desc(list(keys))
        out: list[int | None] = []
        for key in keys:
            size = None
            for replica in found.get(key, ()):
                if replica.is_memory_replica():
                    size = int(replica.get_memory_descriptor().buffer_descriptor.size)
                    break
            out.append(size)
        return out

    def get_into(self, keys: Sequence[str], parts: Sequence[list[Part]]) -> list[tuple[int, str]]:
        engine = self._engine
        if engine is not None:
            return self._read_by_engine(engine, keys, parts)
        return self._client_get_into(keys, parts)

    def _client_get_into(
        self, keys: Sequence[str], parts: Sequence[list[Part]]
    ) -> list[tuple[int, str]]:
        client = self._live()
        codes = client.batch_get_into_multi_buffers(
            list(keys), [[a for a, _ in p] for p in parts], [[n for _, n in p] for p in parts]
        )
        return [(c, "") if c >= 0 else (0, reason_of(c)) for c in codes]

    def read_into(
        self,
        keys: Sequence[str],
        parts: Sequence[list[Part]],
        landed: Callable[[int, int], None] | None = None,
    ) -> list[tuple[int, str]]:
        """Each value scattered into its parts from their start: through the transfer
        engine (the module docstring; ``landed`` is told of each value as it arrives),
        else by the client's gets."""
        engine = self._engine
        if engine is not None:
            return self._read_by_engine(engine, keys, parts, landed)
        return self._read_by_get(keys, parts)

    def _read_by_engine(
        self,
        engine: Any,
        keys: Sequence[str],
        parts: Sequence[list[Part]],
        landed: Callable[[int, int], None] | None = None,
    ) -> list[tuple[int, str]]:
        """Where each value lies (one query), then its pieces read asynchronously, one
        batch per piece (the engine's non-blocking status check answers for a batch's
        first piece only); returns when every batch has finished or failed."""
        found = self._live().batch_get_replica_desc(list(keys))
        out: list[tuple[int, str]] = [(0, "absent")] * len(keys)
        batches: list[tuple[int, int]] = []  # (batch id, key index), in submission order
        elsewhere: list[int] = []  # only on a disk replica: the client's get reads those
        for i, key in enumerate(keys):
            where = None
            replicas = found.get(key, ())
            for replica in replicas:
                if replica.is_memory_replica():
                    where = replica.get_memory_descriptor().buffer_descriptor
                    break
            if where is None:
                if replicas:
                    elsewhere.append(i)
                continue
            size = int(where.size)
            if size > sum(n for _, n in parts[i]):
                out[i] = (0, "too_large")
                continue
            out[i] = (size, "")
            holder = str(where.transport_endpoint)
            remote = int(where.buffer_address)
            for address, nbytes in cut_parts(parts[i], size):
                batch = engine.batch_transfer_async_read(holder, [address], [remote], [nbytes])
                remote += nbytes
                if not batch:  # refused at submission: nothing of it is in flight
                    out[i] = (0, "transfer")
                else:
                    batches.append((batch, i))
        told = None
        if landed is not None:

            def told(i: int) -> None:
                nbytes, reason = out[i]
                if not reason:  # not a key with a piece refused at submission
                    landed(i, nbytes)

        for i in self._wait_all(engine, batches, told):
            out[i] = (0, "transfer")
        if elsewhere:
            got = self._read_by_get([keys[i] for i in elsewhere], [parts[i] for i in elsewhere])
            for i, result in zip(elsewhere, got, strict=True):
                out[i] = result
        return out

    @staticmethod
    def _wait_all(
        engine: Any, batches: list[tuple[int, int]], landed: Callable[[int], None] | None = None
    ) -> set[int]:
        """Sleep until every batch has finished or failed; the key indices that failed.
        The oldest batch is watched (transfers finish about in order); ``landed(i)`` for
        each key whose batches have all finished, as soon as they have."""
        failed: set[int] = set()
        left: dict[int, int] = {}  # key index -> its batches not yet ended
        for _, index in batches:
            left[index] = left.get(index, 0) + 1
        pending = deque(batches)
        started = time.monotonic()
        while pending:
            batch, index = pending[0]
            status = engine.transfer_check_status(batch)
            if status == 0 or status == -2:  # running, or late (it may still land)
                waited = time.monotonic() - started
                slower = sum(waited > after for after in _POLL_SLOWER_AFTER_S)
                time.sleep(_POLL_S[slower])
                continue
            pending.popleft()
            if status < 0:
                failed.add(index)
            left[index] -= 1
            if not left[index] and index not in failed and landed is not None:
                landed(index)
        return failed

    def _read_by_get(
        self, keys: Sequence[str], parts: Sequence[list[Part]]
    ) -> list[tuple[int, str]]:
        """One scattered read into the whole parts (the master's lookup of each key is
        inside Mooncake's get: no size query first). Mooncake 0.3.13 moves a value
        scattered only into parts of exactly its size, and answers a transfer failure
        (-800) for a smaller value: those keys, and only those, are asked their size
        and read again into parts cut to it."""
        got = self._client_get_into(keys, parts)
        again = [i for i, (_, reason) in enumerate(got) if reason == "transfer"]
        if not again:
            return got
        asked: list[int] = []
        cut: list[list[Part]] = []
        for i, size in zip(again, self.sizes([keys[i] for i in again]), strict=True):
            if size is None:
                got[i] = (0, "absent")
            elif size > sum(n for _, n in parts[i]):
                got[i] = (0, "too_large")
            elif size == 0:
                got[i] = (0, "")
            else:
                asked.append(i)
                cut.append(cut_parts(parts[i], size))
        if asked:
            retried = self._client_get_into([keys[i] for i in asked], cut)
            for i, result in zip(asked, retried, strict=True):
                got[i] = result
        return got

    def put_from(self, keys: Sequence[str], parts: Sequence[list[Part]]) -> list[tuple[int, str]]:
        client = self._live()
        codes = client.batch_put_from_multi_buffers(
            list(keys),
            [[a for a, _ in p] for p in parts],
            [[n for _, n in p] for p in parts],
            self._replicate,
        )
        failed = [i for i, c in enumerate(codes) if c < 0 and reason_of(c) == "error"]
        if failed and self.prefer_local:
            # The node's own segment is not (yet) known to the master, e.g. right after
            # a master restart until the client re-mounts it: anywhere in the pool.
            retried = client.batch_put_from_multi_buffers(
                [keys[i] for i in failed],
                [[a for a, _ in parts[i]] for i in failed],
                [[n for _, n in parts[i]] for i in failed],
            )
            for i, code in zip(failed, retried, strict=True):
                codes[i] = code
        sizes = [sum(n for _, n in p) for p in parts]
        return [(n, "") if c >= 0 else (0, reason_of(c)) for c, n in zip(codes, sizes, strict=True)]

    def health(self) -> str | None:
        if self._client is None:
            return "not connected to the Mooncake master"
        rc = self._client.health_check()
        if rc != 0:
            return f"Mooncake health check {rc} (1: closed, 2: master unreachable)"
        # health_check answers from the last heartbeat: ask the master itself.
        code = self._client.batch_is_exist(["kvstore/health"])[0]
        if code < 0:
            return f"master {self.master} unreachable ({reason_of(code)}, {code})"
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "mooncake",
            "master": self.master,
            "hostname": self.hostname,
            "protocol": self.protocol,
            "segment_bytes": self.segment_bytes,
            "reader": "engine" if self._engine is not None else "get",
            **({"reader_fallback": self.engine_error} if self.engine_error else {}),
        }

    def close(self) -> None:
        client, self._client = self._client, None
        self._engine = None
        if client is not None:
            client.close()
