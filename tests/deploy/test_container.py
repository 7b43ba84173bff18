"""The container image (issue 32, item 2). Always: the Dockerfile has the shape the issue asks
for (multi-stage, non-root user, the daemon as entrypoint, the socket directory and the SSD tier
as volumes, a HEALTHCHECK through gRPC health) and its config loads. With a docker daemon
(marked ``docker``): ``scripts/docker-check`` builds the image for real on a base made from
Debian's packages, runs it, and reaches the daemon from the host through the socket volume."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks._support.daemon_proc import REPO
from kvtierd.config import load_daemon_config

DOCKERFILE = (REPO / "Dockerfile").read_text()
CONFIG = REPO / "deploy" / "docker" / "kvtierd.yaml"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def test_dockerfile_shape() -> None:
    steps = _instructions()
    stages = [arg for op, arg in steps if op == "FROM"]
    assert len(stages) == 2 and stages[1].endswith("AS runtime")
    runtime = steps[[op for op, _ in steps].index("FROM", 1) :]
    users = [arg for op, arg in runtime if op == "USER"]
    assert users == ["kvtierd"]  # not root
    (volumes,) = [yaml.safe_load(arg) for op, arg in runtime if op == "VOLUME"]
    config = load_daemon_config(CONFIG)
    assert str(Path(config.socket_path).parent) in volumes
    assert any(config.tier("ssd").path.startswith(v + "/") for v in volumes)
    (entrypoint,) = [yaml.safe_load(arg) for op, arg in runtime if op == "ENTRYPOINT"]
    (cmd,) = [yaml.safe_load(arg) for op, arg in runtime if op == "CMD"]
    assert entrypoint == ["kvtierd"] and cmd == ["serve", "--config", "/etc/kvtierd/kvtierd.yaml"]
    (health,) = [arg for op, arg in runtime if op == "HEALTHCHECK"]
    port = config.health_address.rpartition(":")[2]
    assert f'"kvtierd.server.health_probe", "127.0.0.1:{port}"' in health
    # A client outside the container maps the arena: it must be in the socket volume.
    assert config.tier("cpu").options["arena_dir"] == str(Path(config.socket_path).parent)


def _docker_answers() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    done = subprocess.run([docker, "info"], capture_output=True, timeout=30, check=False)
    return done.returncode == 0


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_image_builds_runs_and_serves_the_host() -> None:
    if not _docker_answers():
        pytest.skip("no docker daemon answers: install docker.io and debootstrap, start dockerd")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("KVTIERD_BUILD_PYTHON", sys.executable)
    done = subprocess.run(["bash", str(REPO / "scripts" / "docker-check")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1700, check=False)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "container healthy" in output
    assert "put/get from the host through the socket volume: ok" in output
    assert "user kvtierd" in output
