"""Start a real ``kvtierd serve`` in a subprocess for tests and benchmarks."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


def certificate(
    directory: Path, name: str = "localhost", issuer: tuple[Path, Path] | None = None
) -> tuple[Path, Path]:
    """A throwaway certificate and key for localhost / 127.0.0.1 (cryptography, no openssl
    binary), written as ``<name>.pem`` / ``<name>.key``: a self-signed CA without ``issuer``,
    else signed by the ``(cert, key)`` files of ``issuer``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
    )
    if issuer is None:
        ca = x509.BasicConstraints(ca=True, path_length=None)
        cert = (
            builder.issuer_name(subject).add_extension(ca, critical=True).sign(key, hashes.SHA256())
        )
    else:
        ca_cert = x509.load_pem_x509_certificate(issuer[0].read_bytes())
        ca_key: Any = serialization.load_pem_private_key(issuer[1].read_bytes(), None)
        cert = builder.issuer_name(ca_cert.subject).sign(ca_key, hashes.SHA256())
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@dataclass(frozen=True)
class TcpListener:
    """A TCP listener with TLS and a daemon token, for ``write_config(**listener.settings)``,
    on port 0 (the daemon binds any free port); clients connect to ``address(daemon)``
    trusting ``ca_file``."""

    ca_file: Path
    settings: dict[str, Any]

    def address(self, daemon: DaemonProcess) -> str:
        return f"localhost:{tcp_port(daemon)}"


def _bound_port(daemon: DaemonProcess, pattern: str, what: str, timeout_s: float = 10) -> int:
    """The port in the newest log line matching ``pattern``. ``start`` returns once the Unix
    socket answers, a moment before the daemon has bound (and logged) its other listeners,
    so this waits for the line."""
    deadline = time.monotonic() + timeout_s
    while not (found := re.findall(pattern, daemon.logs())):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} in the daemon's log:\n{daemon.logs()[-2000:]}")
        time.sleep(0.05)
    return int(found[-1])


def rss_anon(daemon: DaemonProcess) -> int:
    """The daemon's anonymous resident bytes (its Python heap; the CPU tier's arena is shared
    memory, not in it)."""
    assert daemon.proc is not None
    status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
    found = re.search(r"RssAnon:\s+(\d+) kB", status)
    assert found is not None, status
    return int(found.group(1)) << 10


def tcp_port(daemon: DaemonProcess) -> int:
    """The TCP port a started daemon bound: its newest start-up line names it ("serving on
    unix:... and tcp 127.0.0.1:PORT"; a restarted daemon binds another free port)."""
    return _bound_port(daemon, r"serving on unix:\S+ and tcp \S+:(\d+) ", "TCP listener")


def metrics_port(daemon: DaemonProcess) -> int:
    """The /metrics port a daemon started with ``metrics_port: any`` bound, from its newest
    start-up line ("serving on unix:... and metrics http://127.0.0.1:PORT/metrics")."""
    pattern = r"serving on unix:.* and metrics http://\S+:(\d+)/metrics"
    return _bound_port(daemon, pattern, "metrics listener")


def lookup_decisions(daemon: DaemonProcess) -> dict[str, float]:
    """The daemon's ``kvtierd_lookup_decisions`` counts by decision, from its /metrics (a daemon
    started with ``metrics_port: any``)."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{metrics_port(daemon)}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {s.labels["decision"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "kvtierd_lookup_decisions_total"}  # fmt: skip


def health_port(daemon: DaemonProcess) -> int:
    """The port a daemon started with ``health_address: 127.0.0.1:0`` bound for its
    health-only gRPC server, from its newest "grpc health (only) on HOST:PORT" line."""
    return _bound_port(daemon, r"grpc health \(only\) on \S+:(\d+)", "health listener")


def tcp_listener(directory: Path, token: str = "t0ken") -> TcpListener:
    cert, key = certificate(directory)
    token_file = directory / "daemon.token"
    token_file.write_text(token)
    settings = {
        "tcp_address": "127.0.0.1:0",
        "tls": {"cert_file": str(cert), "key_file": str(key)},
        "token_file": str(token_file),
    }
    return TcpListener(cert, settings)


def write_config(
    directory: Path,
    cpu: str = "64MiB",
    ssd: str = "256MiB",
    extra_tiers: list[dict[str, Any]] | None = None,
    cpu_staging: str = "128MiB",
    **settings: Any,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tiers = [
        {"name": "cpu", "kind": "cpu", "capacity": cpu, "options": {"staging_bytes": cpu_staging}},
        {"name": "ssd", "kind": "ssd", "capacity": ssd, "path": str(directory / "ssd")},
        *(extra_tiers or []),
    ]
    if "policy_file" not in settings:
        # Most tests reason about LRU placement; the embedded default (EvicPress) has its own.
        lru = directory / "lru.yaml"
        lru.write_text("name: lru\nplacer: lru\n")
        settings["policy_file"] = str(lru)
    doc = {
        "socket_path": str(directory / "kvtierd.sock"),
        "data_dir": str(directory / "data"),
        "tiers": tiers,
        **settings,
    }
    path = directory / "kvtierd.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


@dataclass
class DaemonProcess:
    config: Path
    socket_path: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    wrapper: tuple[str, ...] = ()  # runs the daemon under this command, e.g. prlimit
    # Every tier's load time from its kind's figure, not from this machine's calibration
    # (tests/given_bandwidths.py): for tests whose placement is not about speed.
    given_bandwidths: bool = False

    def start(self, timeout_s: float = 300.0) -> DaemonProcess:
        # 300 s: at nice 19 beside a long model job a start took over 90 s (the import of
        # torch and the tiers' calibrations); a daemon that exits is seen at once anyway
        from kvtierd.client import KVClient

        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *self.wrapper,
                    sys.executable,
                    "-m",
                    "tests.given_bandwidths" if self.given_bandwidths else "kvtierd.server.main",
                    "serve",
                    "--config",
                    str(self.config),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtierd exited with {self.proc.returncode}:\n{self.logs()}")
            # A gRPC channel per poll against a socket nobody listens on yet (or a killed
            # daemon's stale one) churns grpc's pollers; a plain connect asks first.
            if _listening(self.socket_path):
                try:
                    with KVClient(self.socket_path, timeout_s=2) as c:
                        c.status()
                    return self
                except Exception:
                    pass
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"kvtierd did not answer within {timeout_s}s:\n{self.logs()}")

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
