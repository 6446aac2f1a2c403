"""A loopback cluster for the remote tier's tests and benchmark: a Mooncake master on
free ports, and node processes each with its own store directory and tier manager.

docs/integrations.md, "Beyond one machine". ``MooncakeMaster`` starts, stops and
restarts ``mooncake_master`` (the binary of the ``cluster`` extra) on the same ports;
``Node`` runs ``python -m kvstore.testing.cluster node`` and talks to it one JSON line
per command: ``offer`` (deterministic pages of a name and seed), ``fetch`` (look up
until the remote reads land, load, count the bytes that differ from what the offer
made), ``publish_bad`` (a value with a bad checksum under a real key), ``raw_get`` (the
Mooncake client's own copying ``get`` and ``is_exist``), ``stats``, ``exit``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["MooncakeMaster", "Node", "free_port", "node_config", "pages_of", "running_master"]

PAGE_BYTES = 256 << 10
NAMESPACE = "test-model/float16/tp1/page_first"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MooncakeMaster:
    """``mooncake_master`` on loopback, on ports picked once (a restart reuses them)."""

    def __init__(self, log_path: Path) -> None:
        self.rpc_port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.rpc_port}"
        self._log = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = Path(sys.executable).with_name("mooncake_master")
        with self._log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(binary),
                    f"--rpc_port={self.rpc_port}",
                    f"--metrics_port={self.metrics_port}",
                    "--rpc_address=127.0.0.1",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.rpc_port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"mooncake_master did not listen on {self.address}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@contextlib.contextmanager
def running_master(log_path: Path) -> Iterator[MooncakeMaster]:
    """A started ``MooncakeMaster`` (its log at ``log_path``), stopped on exit."""
    master = MooncakeMaster(log_path)
    master.start()
    try:
        yield master
    finally:
        master.stop()


def node_config(store: str, master: str, **overrides: Any) -> dict[str, Any]:
    """The ``TierConfig`` fields of one node (JSON: the node process builds it)."""
    config: dict[str, Any] = {
        "nvme_path": store,
        "dram_bytes": 64 * PAGE_BYTES,
        "page_bytes": PAGE_BYTES,
        "tokens_per_page": 16,
        "admission": "all",
        "compute_flops": 1e9,  # recomputing is slow here: the plan loads
        "probe_at_open": False,
        "remote_backend": "mooncake",
        "remote_options": {"master": master, "segment_bytes": 64 << 20},
        "remote_namespace": NAMESPACE,
        "remote_deadline_s": 1.0,
        "remote_health_s": 0.2,
    }
    config.update(overrides)
    return config


def pages_of(name: str, count: int, seed: int) -> tuple[list[bytes], list[Any]]:
    """``count`` chained keys and their deterministic page bytes."""
    import torch

    g = torch.Generator().manual_seed(seed)
    keys = [f"{name}/{i}".encode() for i in range(count)]
    pages = [torch.randint(0, 256, (PAGE_BYTES,), dtype=torch.uint8, generator=g) for _ in keys]
    return keys, pages


class Node:
    """A node process: its own store directory, tier manager and Mooncake client."""

    def __init__(self, config: dict[str, Any], log_path: Path) -> None:
        self._log = log_path.open("ab")
        env = dict(os.environ, GLOG_minloglevel="2")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.testing.cluster", "node", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
        )
        self.call("ping", timeout_s=60)

    def call(self, op: str, timeout_s: float = 30, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = _readline(self.proc, timeout_s)
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"node {op}: {out['error']}")
        return out

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout_s=20)
            except Exception:
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def _readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        raise TimeoutError(f"the node did not answer within {timeout_s} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the node exited ({proc.poll()})")
    return line


# -- the node process ------------------------------------------------------------------


def _node(config_json: str) -> int:
    import torch

    from kvstore.format.remote import encode_remote_header_into, remote_key
    from kvstore.tiering import TierConfig, TierManager

    tm = TierManager.open(TierConfig(**json.loads(config_json)))
    remote: Any = tm._remote

    def summary() -> dict[str, Any]:
        return dict(tm.stats().remote or {})

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            out: dict[str, Any] = {}
            if op == "ping":
                pass
            elif op == "wait_up":
                deadline = time.monotonic() + float(cmd.get("timeout_s", 15))
                want = cmd.get("state", "up")
                while summary()["state"] != want and time.monotonic() < deadline:
                    time.sleep(0.05)
                out["state"] = summary()["state"]
                out["reason"] = summary()["degraded_reason"]
            elif op == "offer":
                keys, pages = pages_of(cmd["name"], cmd["count"], cmd["seed"])
                offered = tm.offer(keys, pages)
                tm.drain(10)
                deadline = time.monotonic() + float(cmd.get("wait_s", 10))
                while summary()["published"] < cmd.get("published", 0):
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
                out["admitted"] = offered.admitted
            elif op == "fetch":
                keys, pages = pages_of(cmd["name"], cmd["count"], cmd["seed"])
                started = time.monotonic()
                result = tm.lookup(keys)
                out["first_lookup_s"] = time.monotonic() - started
                out["first_pending"] = result.remote_pending
                deadline = time.monotonic() + float(cmd.get("timeout_s", 10))
                while result.remote_pending and time.monotonic() < deadline:
                    time.sleep(0.01)
                    result = tm.lookup(keys)
                out["hit"] = result.hit_pages
                dst = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in range(result.hit_pages)]
                if result.plan.load_pages:
                    handle = tm.prepare_load(result.plan, dst)
                    handle.wait(10)
                    tm.complete_load(handle)
                    out["loaded"] = handle.loaded_pages
                else:
                    out["loaded"] = 0
                out["wrong_bytes"] = sum(
                    int((d != p).sum()) for d, p in zip(dst[: out["loaded"]], pages, strict=False)
                )
            elif op == "publish_bad":
                keys, pages = pages_of(cmd["name"], cmd["count"], cmd["seed"])
                import numpy as np

                value = np.zeros(4096 + PAGE_BYTES, dtype=np.uint8)
                payload = pages[0].numpy()
                encode_remote_header_into(
                    memoryview(value[:4096].data),
                    namespace=NAMESPACE,
                    key=keys[0],
                    payload=payload,
                    parent=None,
                    depth=0,
                    tokens=16,
                )
                value[4096:] = payload
                value[4096 + 1000] ^= 0xFF
                client = remote._backend.client
                out["rc"] = client.put(remote_key(NAMESPACE, keys[0]), value.tobytes())
            elif op == "raw_get":
                keys, _ = pages_of(cmd["name"], cmd["count"], cmd["seed"])
                client = remote._backend.client
                name = remote_key(NAMESPACE, keys[0])
                out["exist"] = client.is_exist(name)
                out["get_bytes"] = len(client.get(name))
            elif op == "stats":
                stats = tm.stats()
                out = {"remote": summary(), "pages_by_tier": list(stats.pages_by_tier)}
            elif op == "exit":
                print(json.dumps({}), flush=True)
                break
            else:
                out = {"error": f"unknown op {op}"}
        except Exception as e:
            out = {"error": repr(e)}
        print(json.dumps(out, default=str), flush=True)
    tm.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "node":
        return _node(args[1])
    print("usage: python -m kvstore.testing.cluster node CONFIG_JSON", file=sys.stderr)
    return 2


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
