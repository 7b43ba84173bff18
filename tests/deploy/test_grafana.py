"""deploy/grafana/kvtierd.json (issue 32, item 4) against a real Prometheus (Debian's
``prometheus``, installed by scripts/setup) scraping a real daemon that serves traffic while
the test runs: every panel's PromQL is evaluated through Prometheus' HTTP API and returns data,
and every metric it names is one the daemon exports."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks._support.daemon_proc import REPO, DaemonProcess, metrics_port, write_config
from kvtierd.client import KVClient
from kvtierd.errors import NotFoundError
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.rpc import kvtier_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

DASHBOARD = REPO / "deploy" / "grafana" / "kvtierd.json"
# What Grafana puts in before it sends a query: the rate window and "all daemons".
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$instance": ".*"}


def _targets() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def _expand(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode()
    return json.loads(body) if body.startswith("{") else body


def _wait(what: str, ready: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not ready within {timeout_s} s")
        time.sleep(0.2)


def _traffic(socket_path: str, stop: threading.Event) -> None:
    """Puts, hits, misses, NOT_FOUND errors, and a profiler run (it fails: no token ids are
    known for the context; a failed run is a run)."""
    import torch

    layers, tokens, heads, dim = 2, 16, 2, 64
    layout = ChunkFormat((2, layers, tokens, heads * dim), "bfloat16", heads).layout()
    with KVClient(socket_path) as c:
        kv = torch.randn(2, layers, tokens, heads * dim).to(torch.bfloat16)
        c.put("doc/0", kv, context_id="doc", layout=layout, token_count=tokens)
        c.call(c.admin.Profile, pb.ProfileRequest(context_ids=["doc"]))
        i = 0
        while not stop.is_set():
            c.put(f"t/{i}", np.full(16 << 10, i % 251, np.uint8), context_id=f"t{i % 8}")
            c.put(f"ns:team-a:t/{i}", np.zeros(1 << 10, np.uint8), context_id=f"ns:team-a:{i % 8}")
            c.get(f"t/{i}")
            c.lookup([f"absent/{i}"])
            c.lookup([f"t/{i}", f"absent/{i}"], request=True)  # a partial hit
            with pytest.raises(NotFoundError):
                c.get(f"absent/{i}")
            i += 1
            stop.wait(0.1)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus missing: scripts/setup installs Debian's package")
    work = tmp_path_factory.mktemp("prom")
    evicpress = REPO / "configs" / "policies" / "evicpress.yaml"  # it profiles; lru does not
    config = write_config(work / "d", metrics_port="any", policy_file=str(evicpress),
                          namespaces=[{"name": "team-a", "quota": {"cpu": "8MiB"}}])  # fmt: skip
    daemon = DaemonProcess(config, str(work / "d" / "kvtierd.sock"), work / "daemon.log").start()
    scrape_port = metrics_port(daemon)
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: kvtierd\n    static_configs: [{{targets: ['127.0.0.1:{scrape_port}']}}]\n"
    )
    stop = threading.Event()
    traffic = threading.Thread(target=_traffic, args=(daemon.socket_path, stop))
    traffic.start()
    with open(work / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={work / 'tsdb'}", "--web.listen-address=127.0.0.1:0"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _wait("prometheus", lambda: _listening_on(work / "prometheus.log") is not None)
        api = f"http://{_listening_on(work / 'prometheus.log')}/api/v1"
        _wait("prometheus", lambda: _up(api))
        time.sleep(8)  # several scrapes with traffic between them: rates need two samples
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{scrape_port}/metrics").read()
        yield {"api": api, "metrics": scraped.decode()}
    finally:
        stop.set()
        traffic.join(10)
        proc.terminate()
        proc.wait(20)
        daemon.kill()


def _listening_on(log: Path) -> str | None:
    """The address Prometheus bound for ``--web.listen-address=127.0.0.1:0``: its log's
    "Listening on" line names the real port (the line before it repeats the configured 0)."""
    found = re.findall(r'msg="Listening on" address=(\S+)', log.read_text(errors="replace"))
    return found[-1] if found else None


def _up(api: str) -> bool:
    try:
        answer = _get(f"{api}/query?query=up")
    except OSError:
        return False
    return any(r["value"][1] == "1" for r in answer["data"]["result"])


def _query(api: str, expr: str) -> list[dict[str, Any]]:
    answer = _get(f"{api}/query?" + urllib.parse.urlencode({"query": _expand(expr)}))
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


@pytest.mark.parametrize(("title", "expr"), _targets(), ids=[e for _, e in _targets()])
def test_panel_query_returns_data(prometheus: dict[str, Any], title: str, expr: str) -> None:
    series = _query(prometheus["api"], expr)
    assert series, f"{title}: {expr} returned nothing"
    values = [float(s["value"][1]) for s in series]
    assert any(not math.isnan(v) for v in values), f"{title}: {expr} -> {values}"


def test_every_metric_named_is_exported(prometheus: dict[str, Any]) -> None:
    exported = {
        s.name for f in text_string_to_metric_families(prometheus["metrics"]) for s in f.samples
    }
    named = {m for _, expr in _targets() for m in re.findall(r"\bkvtierd_[a-z_]+", expr)}
    assert named - exported == set()
    # The dashboard draws every family the daemon exports (a new metric needs a panel).
    families = {f.name for f in text_string_to_metric_families(prometheus["metrics"])}
    drawn = {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in named}
    families = {f for f in families if f.startswith("kvtierd_") and not f.endswith("_created")}
    assert families - drawn == set()


def test_a_wrong_metric_name_would_be_caught(prometheus: dict[str, Any]) -> None:
    """The checks above can fail: a misspelt metric returns no data."""
    assert _query(prometheus["api"], "rate(kvtierd_hit_total[$__rate_interval])") == []
