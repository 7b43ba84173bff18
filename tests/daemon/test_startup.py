"""Issue 16 (8): bounds on leases, holds and stream parts; the socket directory forced
private; clean start-up errors that leave no socket behind; one default policy and a config
that works from any working directory."""

from __future__ import annotations

import math
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml

from benchmarks._support.daemon_proc import REPO, DaemonProcess, certificate, write_config
from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.config import load_daemon_config
from kvtierd.policies.loader import default_policy, load_policy
from kvtierd.rpc import kvtier_pb2 as pb


@pytest.mark.parametrize("seconds", [1e300, math.inf, math.nan, -1.0, 3601.0])
def test_leases_and_holds_are_bounded(start_daemon, seconds):
    d = start_daemon()
    with KVClient(d.socket_path) as c:
        c.put("k", b"x" * 4096)
        with pytest.raises(errors.InvalidArgumentError, match="between 0 and 3600 seconds"):
            c.call(c.kv.Get, pb.GetRequest(keys=["k"], lease_s=seconds))
        with pytest.raises(errors.InvalidArgumentError, match="between 0 and 3600 seconds"):
            c.lookup(["k"], hold_s=seconds)
        assert c.status().leases == 0
        with c.lease("k", lease_s=3600) as (_, view):
            assert bytes(view) == b"x" * 4096


def test_get_stream_parts_are_bounded(start_daemon):
    d = start_daemon()
    with KVClient(d.socket_path) as c:
        c.put("k", os.urandom(64 << 10))
        stream = c._channel.unary_stream(
            "/kvtierd.v1.KVStore/GetStream",
            pb.GetStreamRequest.SerializeToString,
            pb.GetPart.FromString,
        )
        for part in (1, 65535, (16 << 20) + 1):
            with pytest.raises(grpc.RpcError) as refused:
                list(stream(pb.GetStreamRequest(key="k", part_bytes=part)))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert "part_bytes must be 0" in refused.value.details()  # type: ignore[attr-defined]
        replies = list(stream(pb.GetStreamRequest(key="k", part_bytes=64 << 10)))
        assert len(replies) == 2  # the info, then one 64 KiB part (1 B parts: 65,537)


def test_an_existing_socket_directory_is_made_private(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    config = write_config(tmp_path / "d")
    doc = yaml.safe_load(config.read_text())
    doc["socket_path"] = str(run / "kvtierd.sock")
    config.write_text(yaml.safe_dump(doc))
    d = DaemonProcess(config, str(run / "kvtierd.sock"), tmp_path / "log").start()
    try:
        assert stat.S_IMODE(run.stat().st_mode) == 0o700
        assert stat.S_IMODE(os.stat(run / "kvtierd.sock").st_mode) == 0o600
    finally:
        d.kill()


def _start_fails(config: Path, socket_path: str, log: Path) -> str:
    d = DaemonProcess(config, socket_path, log)
    with pytest.raises(RuntimeError, match="kvtierd exited with 2") as failed:
        d.start(timeout_s=30)
    return str(failed.value)


@pytest.mark.parametrize("problem", ["missing key", "garbage key", "address in use"])
def test_a_bad_tcp_listener_is_a_clean_start_up_error(tmp_path, problem):
    cert, key = certificate(tmp_path)
    (tmp_path / "token").write_text("t")
    if problem == "missing key":
        key = tmp_path / "no-such.key"
    elif problem == "garbage key":
        key.write_text("not a key")
    port = 0  # any free port, or the one the holder took (bound here, never chosen before)
    holder = socket.socket()
    if problem == "address in use":
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
    try:
        config = write_config(
            tmp_path / "d",
            tcp_address=f"127.0.0.1:{port}",
            tls={"cert_file": str(cert), "key_file": str(key)},
            token_file=str(tmp_path / "token"),
        )
        sock = tmp_path / "d" / "kvtierd.sock"
        text = _start_fails(config, str(sock), tmp_path / "log")
    finally:
        holder.close()
    assert "Traceback" not in text
    expected = {"missing key": "cannot read tls.key_file", "garbage key": "grpc refused",
                "address in use": "cannot listen on tcp"}[problem]  # fmt: skip
    assert expected in text, text
    assert not sock.exists()  # no stale socket


def test_tls_without_a_key_file_is_a_config_error(tmp_path):
    config = write_config(tmp_path, tls={"cert_file": "c.pem"})
    with pytest.raises(errors.ConfigError, match="tls: key_file is required"):
        load_daemon_config(config)


def test_an_empty_policy_file_means_the_embedded_evicpress(start_daemon):
    assert default_policy().placer == "evicpress"
    d = start_daemon(policy_file="")
    with KVClient(d.socket_path) as c:
        assert c.status().placer == "evicpress"


def test_the_example_config_works_from_any_directory(tmp_path):
    """configs/kvtierd.yaml names its policy relative to itself: from another working
    directory it used to point nowhere."""
    code = (
        "from kvtierd.config import load_daemon_config\n"
        "from kvtierd.policies.loader import load_policy\n"
        f"c = load_daemon_config({str(REPO / 'configs' / 'kvtierd.yaml')!r})\n"
        "print(c.policy_file, load_policy(c.policy_file).placer)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    path, placer = done.stdout.split()
    assert Path(path) == REPO / "configs" / "policies" / "evicpress.yaml"
    assert placer == "evicpress"
    assert load_policy(path).name == "evicpress"
