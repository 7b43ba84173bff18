"""Real ``redis-server`` processes in cluster mode on loopback ports, for the remote tier's tests.

``RedisClusterProcs`` starts N masters (default 3), each in its own directory with its own
``nodes.conf``, joins them into one cluster (``redis-cli --cluster create`` when ``redis-cli``
exists, else CLUSTER ADDSLOTSRANGE + CLUSTER MEET from Python) and waits for
``cluster_state:ok`` on every node. ``kill(i)`` / ``restart(i)`` inject node faults; a restarted
node keeps its port and its ``nodes.conf`` so it rejoins with its node id and slots.

Every wait is bounded; ``stop()`` kills every process it started (SIGTERM, then SIGKILL).
``cluster-require-full-coverage no`` is set so the surviving masters keep serving their slots
while one is down — the setting docs/remote-tier.md recommends for a cache.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

REDIS_SERVER = "/usr/bin/redis-server"
NODE_TIMEOUT_MS = 1000
SLOTS = 16384


class RedisClusterError(RuntimeError):
    """The test cluster could not be started or did not become healthy in time."""


class _PortInUseError(RedisClusterError):
    """redis-server exited at start-up: its port or bus port was taken."""


def redis_server_path() -> str:
    """Path to ``redis-server``; raises (so tests FAIL, not skip) when it is not installed."""
    found = shutil.which("redis-server") or (REDIS_SERVER if Path(REDIS_SERVER).exists() else None)
    if found is None:
        raise RedisClusterError(
            "redis-server is not installed: the remote-tier tests need it "
            "(scripts/setup installs Debian's redis-server package; "
            "or: apt-get install redis-server)"
        )
    return found


def _candidate_port(taken: set[int]) -> int:
    """A loopback port p, not yet used by this cluster, to *try*: p and its bus port p+10000
    must both be free, and only starting ``redis-server`` on them can tell (see
    :meth:`RedisClusterProcs._start_node`)."""
    while True:
        port = random.randint(20000, 40000)
        if not {port, port + 10000} & taken:
            return port


@dataclass(slots=True)
class _Node:
    port: int
    directory: Path
    proc: subprocess.Popen[bytes] | None = None


class RedisClusterProcs:
    """A throw-away Redis Cluster of ``masters`` masters under ``base_dir`` on 127.0.0.1.

    The one place in the tests that picks a port before binding it, and why: ``redis-server
    --port 0`` means "no TCP listener", not "any free port", and a cluster node needs a TCP
    port (clients follow MOVED replies to host:port) plus its bus port (port+10000, which
    ``CLUSTER MEET`` assumes). So a node is started on a random candidate port and kept only
    once it answers PING with its own process id; a node that exits with "Address already in
    use" (someone else holds the port or its bus port) is started again on another candidate.
    Nothing is bound and closed first to "check" a port: that only moves the race.
    ``restart`` reuses a killed node's port (it must, to rejoin with its ``nodes.conf``); if
    another process took it meanwhile, the restart fails with redis-server's log.
    """

    def __init__(self, base_dir: Path, masters: int = 3, start_timeout_s: float = 20.0) -> None:
        self.server = redis_server_path()
        self.start_timeout_s = start_timeout_s
        self.nodes = [_Node(0, base_dir / f"node-{i}") for i in range(masters)]

    @property
    def addresses(self) -> list[str]:
        """Startup nodes as ``"host:port"`` strings (the remote tier's ``nodes`` option)."""
        return [f"127.0.0.1:{n.port}" for n in self.nodes]

    def client(self, port: int) -> redis.Redis:
        """A plain (non-cluster) client to one node, with short timeouts."""
        return redis.Redis(
            host="127.0.0.1", port=port, socket_timeout=2.0, socket_connect_timeout=1.0
        )

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        try:
            for node in self.nodes:
                node.directory.mkdir(parents=True, exist_ok=True)
                self._start_node(node)
            self._create_cluster()
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for node in self.nodes:
            self._terminate(node)

    def kill(self, index: int) -> int:
        """SIGKILL one node (a crash: no shutdown, no save); returns its port."""
        node = self.nodes[index]
        if node.proc is not None:
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait(timeout=10)
            node.proc = None
        return node.port

    def restart(self, index: int) -> None:
        """Start a killed node again on its port with its ``nodes.conf`` (same id, same slots)."""
        node = self.nodes[index]
        if node.proc is not None:
            raise RedisClusterError(f"node {node.port} is still running")
        self._spawn(node)
        self._wait_ping(node)

    def wait_ok(self, timeout_s: float | None = None) -> None:
        """Wait until every running node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        pending = [n for n in self.nodes if n.proc is not None]
        while pending:
            pending = [n for n in pending if not self._state_ok(n)]
            if pending and time.monotonic() > deadline:
                ports = ", ".join(str(n.port) for n in pending)
                raise RedisClusterError(f"cluster_state not ok on {ports} after timeout")
            if pending:
                time.sleep(0.05)

    def port_of_slot(self, slot: int) -> int:
        """The port of the master serving ``slot`` (asked of the first running node)."""
        running = next(n for n in self.nodes if n.proc is not None)
        with self.client(running.port) as c:
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        raise RedisClusterError(f"slot {slot} is not assigned")

    def index_of_port(self, port: int) -> int:
        return next(i for i, n in enumerate(self.nodes) if n.port == port)

    # -- helpers ---------------------------------------------------------------------------

    def _start_node(self, node: _Node, tries: int = 20) -> None:
        """Start ``node`` on a candidate port, again on another while the one tried is in use."""
        taken = {p for n in self.nodes if n.port for p in (n.port, n.port + 10000)}
        for _ in range(tries):
            node.port = _candidate_port(taken)
            self._spawn(node)
            try:
                self._wait_ping(node)
                return
            except _PortInUseError:
                node.proc = None
        raise RedisClusterError(f"no free port pair for redis-server in {tries} tries")

    def _spawn(self, node: _Node) -> None:
        args = [
            self.server,
            "--bind", "127.0.0.1",
            "--port", str(node.port),
            "--dir", str(node.directory),
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--cluster-require-full-coverage", "no",
            "--save", "",
            "--appendonly", "no",
            "--logfile", str(node.directory / "redis.log"),
        ]  # fmt: skip
        node.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def _wait_ping(self, node: _Node) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if node.proc is not None and node.proc.poll() is not None:
                log = node.directory / "redis.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                log.unlink(missing_ok=True)  # the next try on this directory logs afresh
                if "Address already in use" in tail:
                    raise _PortInUseError(node.port)
                raise RedisClusterError(f"redis-server on {node.port} exited:\n{tail}")
            # Before the PING: a PING to a port another process holds can block past the
            # deadline, and an exit meanwhile is the answer ("Address already in use").
            if time.monotonic() > deadline:
                raise RedisClusterError(f"redis-server on {node.port} did not answer PING")
            with contextlib.suppress(redis.RedisError), self.client(node.port) as c:
                # Our process, not another one that already listened on the port.
                if c.ping() and node.proc is not None and self._pid(c) == node.proc.pid:
                    return
            time.sleep(0.05)

    @staticmethod
    def _pid(c: redis.Redis) -> int:
        return int(c.info("server")["process_id"])

    def _create_cluster(self) -> None:
        cli = shutil.which("redis-cli")
        if cli is not None and len(self.nodes) >= 3:  # redis-cli creates 3 masters or more
            cmd = [cli, "--cluster", "create", *self.addresses]
            cmd += ["--cluster-replicas", "0", "--cluster-yes"]
            done = subprocess.run(
                cmd, capture_output=True, timeout=self.start_timeout_s, check=False
            )
            if done.returncode != 0:
                out = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
                raise RedisClusterError(f"redis-cli --cluster create failed:\n{out}")
            return
        self._create_cluster_by_hand()

    def _create_cluster_by_hand(self) -> None:
        """Assign contiguous slot ranges, then introduce every node to the first."""
        share = SLOTS // len(self.nodes)
        for i, node in enumerate(self.nodes):
            first = i * share
            last = SLOTS - 1 if i == len(self.nodes) - 1 else first + share - 1
            with self.client(node.port) as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        first_port = self.nodes[0].port
        for node in self.nodes[1:]:
            with self.client(node.port) as c:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", first_port)

    def _state_ok(self, node: _Node) -> bool:
        try:
            with self.client(node.port) as c:
                info = c.execute_command("CLUSTER", "INFO")
        except redis.RedisError:
            return False
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text

    def _terminate(self, node: _Node) -> None:
        proc, node.proc = node.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
