"""TCP is opt-in and then needs TLS and a bearer token: a client with the CA and the token
puts and gets (bytes streamed); a wrong or missing token is refused; the config without TLS is
rejected at start."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest

from kvtierd import errors
from kvtierd.client import KVClient
from tests.daemon_proc import DaemonProcess, write_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A throwaway certificate for localhost / 127.0.0.1 (cryptography, no openssl binary)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tcp_with_tls_and_token(start_daemon, tmp_path):
    cert, key = _self_signed(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    port = _free_port()
    d = start_daemon(
        tcp_address=f"127.0.0.1:{port}",
        tls={"cert_file": str(cert), "key_file": str(key)},
        token_file=str(token_file),
    )
    x = np.arange(3 << 20, dtype=np.int32)
    with KVClient(address=f"localhost:{port}", tls_ca_file=str(cert), token="s3cret-token") as c:
        assert not c.use_arena  # another host's view: bytes are streamed
        c.put("remote-put", x, context_id="r")
        assert np.array_equal(c.get("remote-put"), x)
    with (
        KVClient(address=f"localhost:{port}", tls_ca_file=str(cert), token="wrong") as c,
        pytest.raises(errors.PermissionDeniedError, match="bearer token"),
    ):
        c.status()
    with KVClient(d.socket_path) as c:  # the Unix socket needs no token
        assert c.lookup(["remote-put"]).found == (True,)


def _signed(directory: Path, name: str, ca_cert, ca_key) -> tuple[Path, Path]:
    """A certificate for ``name`` signed by the test CA."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
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


def test_mutual_tls_requires_a_client_certificate(start_daemon, tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca_path, ca_key_path = _self_signed(tmp_path)
    ca_cert = x509.load_pem_x509_certificate(ca_path.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
    server_cert, server_key = _signed(tmp_path, "server", ca_cert, ca_key)
    client_cert, client_key = _signed(tmp_path, "client", ca_cert, ca_key)
    (tmp_path / "token").write_text("t0ken")
    port = _free_port()
    start_daemon(
        tcp_address=f"127.0.0.1:{port}",
        tls={"cert_file": str(server_cert), "key_file": str(server_key),
             "client_ca_file": str(ca_path)},
        token_file=str(tmp_path / "token"),
    )  # fmt: skip
    addr = f"localhost:{port}"
    with KVClient(address=addr, tls_ca_file=str(ca_path), token="t0ken", timeout_s=5,
                  tls_cert_file=str(client_cert), tls_key_file=str(client_key)) as c:  # fmt: skip
        c.put("m", b"mutual")
        assert bytes(c.get("m")) == b"mutual"
    with (
        KVClient(address=addr, tls_ca_file=str(ca_path), token="t0ken", timeout_s=5) as c,
        pytest.raises(errors.UnavailableError),
    ):
        c.status()  # no client certificate: the TLS handshake fails


def test_tcp_without_tls_is_refused(tmp_path):
    config = write_config(tmp_path, tcp_address="127.0.0.1:1")
    d = DaemonProcess(config, str(tmp_path / "kvtierd.sock"), tmp_path / "log")
    with pytest.raises(RuntimeError, match="requires both tls"):
        d.start(timeout_s=20)
