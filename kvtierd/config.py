"""Daemon configuration: typed, frozen, validated from YAML with errors that name file:line.

``load_daemon_config(path)`` reads ``configs/kvtierd.yaml``-style files; ``default_config()``
is the embedded default used by ``kvtierd serve`` without ``--config``: a CPU tier sized from
available memory, an SSD tier in the data dir, a GPU tier only when CUDA is present.
Every key is documented in docs/configuration.md; unknown keys are errors. The YAML reader
that names file:line is ``yaml_source.py`` (the policy reader uses it too); the host probes the
default reads are ``environment.py``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from kvtierd import namespaces
from kvtierd.environment import (
    available_memory_bytes,
    cuda_available,
    data_dir,
    default_socket_path,
)
from kvtierd.errors import ConfigError
from kvtierd.yaml_source import YamlSource, read_file

MAX_LEASE_S = 3600.0
MAX_COMPUTE_THREADS = 1024
MAX_PORT = 65535
"""The longest read lease (``lease_s``, ``Get.lease_s``) or lookup hold (``Lookup.hold_s``)."""

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip


def parse_size(value: object, where: str = "size") -> int:
    """``"64MiB"`` / ``"8GB"`` / ``1048576`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size like 8GiB or a byte count, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}: size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            unit = (m.group(2) or "B").lower()
            return int(float(m.group(1)) * _UNITS[unit])
    raise ConfigError(
        f"{where}: expected a size like 8GiB, 512MiB, 10GB or a byte count, got {value!r}"
    )


LOOKUP_DECISIONS = ("decide", "load", "recompute")
"""``lookup_decision``: per lookup, the system's rule; always load; always recompute."""


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One tier. ``kind`` picks the implementation (cpu, ssd, gpu, remote); ``options`` holds
    kind-specific settings, each documented with its tier."""

    name: str
    kind: str
    capacity_bytes: int
    path: str = ""
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert_file: str
    key_file: str
    client_ca_file: str = ""  # set to require mutual TLS


@dataclass(frozen=True, slots=True)
class NamespaceConfig:
    """A namespace inside a tenant (issue 41.2): the keys that begin ``ns:<name>:``
    (``kvtierd.namespaces``; the LMCache plugin makes them from a request's ``cache_salt``).
    ``quota_bytes`` caps its bytes per tier name, inside its tenant's own quota."""

    name: str
    quota_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """A namespace of keys and contexts. On TCP the bearer token in ``token_file`` identifies
    the tenant; on the Unix socket (trusted, mode 0600) the ``x-kvtierd-tenant`` metadata
    does. ``quota_bytes`` caps the tenant's bytes per tier name; ``admin`` allows the Admin
    service over TCP."""

    name: str
    token_file: str = ""
    quota_bytes: dict[str, int] = field(default_factory=dict)
    admin: bool = False
    namespaces: tuple[NamespaceConfig, ...] = ()


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """The daemon's settings. ``socket_path`` is always served (mode 0600); ``tcp_address``
    only when set, and then ``tls`` and a token are required."""

    socket_path: str
    data_dir: str
    tiers: tuple[TierConfig, ...]
    tcp_address: str = ""
    tls: TlsConfig | None = None
    token_file: str = ""
    tenants: tuple[TenantConfig, ...] = ()
    namespaces: tuple[NamespaceConfig, ...] = ()  # the default tenant's (a tenant's: its own)
    policy_file: str = ""  # a configs/policies/*.yaml document; empty = the embedded EvicPress
    lease_s: float = 30.0
    allocation_timeout_s: float = 60.0
    max_object_bytes: int = 4 << 30
    prefill_tokens_per_s: float = 5000.0  # vLLM's prefill speed, for the TTFT model
    profile_quiet_s: float = 2.0  # background profiling waits this long after the last read
    compute_threads: int = 0  # torch threads for profiling and compression; 0 = half the cores
    token_bytes_per_tenant: int = 64 << 20  # SetContextTokens ids kept per tenant (4 B an id)
    # Directories a policy applied at run time (Admin.ApplyPolicy) may name as
    # profiling.model_dir; () = kvtierd's model cache. The policy_file's own is always allowed.
    model_dirs: tuple[str, ...] = ()
    # Prometheus /metrics: 0 = off, a port number, or "any": any free port, named in the
    # start-up log line (tests and side-by-side daemons that must not pick a port first).
    metrics_port: int | Literal["any"] = 0
    metrics_address: str = "127.0.0.1"  # 0.0.0.0 in a pod, where Prometheus scrapes the pod IP
    log_json: bool = False
    # A graceful stop (SIGTERM) writes the CPU tier's most recently used contexts to the SSD
    # tier for at most this long, so that a restart still has them; 0 turns it off.
    shutdown_flush_s: float = 5.0
    # host:port of a plain gRPC server with only grpc.health.v1 on it (Kubernetes' native
    # grpc probes cannot use a Unix socket or TLS); empty = none. No data RPC is served there.
    health_address: str = ""
    # What a Lookup that asks for the decision (the LMCache plugin's) reports of the chunks it
    # found: "decide" the prefix whose load beats its prefill (engine/lookup_decision.py),
    # "load" all of them, "recompute" none (comparison runs).
    lookup_decision: str = "decide"

    def tier(self, name: str) -> TierConfig:
        for t in self.tiers:
            if t.name == name:
                return t
        known = ", ".join(t.name for t in self.tiers)
        raise ConfigError(f"no tier named {name!r}; configured tiers: {known}")


def default_config() -> DaemonConfig:
    """The embedded default: CPU tier = 25% of available memory (at most 64 GiB), SSD tier =
    64 GiB (at most half the free space) under the data dir, GPU tier only with CUDA."""
    data = data_dir()
    cpu_bytes = min(available_memory_bytes() // 4, 64 << 30)
    ssd_path = data / "ssd"
    probe = ssd_path if ssd_path.exists() else data.parent if data.parent.exists() else Path("/")
    st = os.statvfs(probe)
    ssd_bytes = min(64 << 30, st.f_bavail * st.f_frsize // 2)
    tiers = [
        TierConfig("cpu", "cpu", cpu_bytes),
        TierConfig("ssd", "ssd", ssd_bytes, str(ssd_path)),
    ]
    if cuda_available():
        tiers.insert(0, TierConfig("gpu", "gpu", 4 << 30))
    return DaemonConfig(socket_path=default_socket_path(), data_dir=str(data), tiers=tuple(tiers))


def _check_keys(
    raw: dict[str, Any], allowed: set[str], src: YamlSource, at: tuple[str, ...]
) -> None:
    for key in raw:
        if key not in allowed:
            raise ConfigError(
                f"{src.where((*at, key))}: unknown key; allowed keys: {', '.join(sorted(allowed))}"
            )


def _tier(raw: object, src: YamlSource, at: tuple[str, ...]) -> TierConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{src.where(at)}: a tier must be a mapping with name, kind, capacity")
    _check_keys(raw, {"name", "kind", "capacity", "path", "options"}, src, at)
    for key in ("name", "kind", "capacity"):
        if key not in raw:
            raise ConfigError(f"{src.where(at)}: tier is missing required key {key!r}")
    options = raw.get("options") or {}
    if not isinstance(options, dict):
        raise ConfigError(f"{src.where((*at, 'options'))}: must be a mapping")
    return TierConfig(
        name=str(raw["name"]),
        kind=str(raw["kind"]),
        capacity_bytes=parse_size(raw["capacity"], src.where((*at, "capacity"))),
        path=str(raw.get("path", "")),
        options=dict(options),
    )


def load_daemon_config(path: str | os.PathLike[str]) -> DaemonConfig:
    """Read and validate a daemon config file; missing keys take the embedded defaults."""
    p = Path(path)
    src = YamlSource(str(p), read_file(p, "config"))
    raw = src.data or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of settings")
    base = default_config()
    names = {f.name for f in fields(DaemonConfig)}
    _check_keys(raw, names, src, ())
    values: dict[str, Any] = {}
    for key, value in sorted(raw.items(), key=lambda kv: kv[0] != "tiers"):
        if key == "tiers":
            if not isinstance(value, list) or not value:
                raise ConfigError(f"{src.where(('tiers',))}: must be a non-empty list of tiers")
            tiers = tuple(_tier(t, src, ("tiers", str(i))) for i, t in enumerate(value))
            seen: set[str] = set()
            for i, t in enumerate(tiers):
                if t.name in seen:
                    where = src.where(("tiers", str(i), "name"))
                    raise ConfigError(f"{where}: duplicate tier name {t.name!r}")
                seen.add(t.name)
            values[key] = tiers
        elif key == "tls":
            if not isinstance(value, dict):
                raise ConfigError(f"{src.where(('tls',))}: must be a mapping")
            _check_keys(value, {"cert_file", "key_file", "client_ca_file"}, src, ("tls",))
            for required in ("cert_file", "key_file"):
                if not value.get(required):
                    raise ConfigError(f"{src.where(('tls',))}: {required} is required")
            values[key] = TlsConfig(**{k: str(v) for k, v in value.items()})
        elif key == "tenants":
            values[key] = _tenants(value, src, {t.name for t in values.get("tiers", base.tiers)})
        elif key == "namespaces":
            tier_names = {t.name for t in values.get("tiers", base.tiers)}
            values[key] = _namespaces(value, src, ("namespaces",), tier_names)
        elif key == "model_dirs":
            if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
                raise ConfigError(f"{src.where((key,))}: must be a list of directories")
            values[key] = tuple(value)
        elif key == "metrics_port":
            values[key] = _metrics_port(value, src)
        elif key in ("max_object_bytes", "token_bytes_per_tenant"):
            values[key] = parse_size(value, src.where((key,)))
        else:
            values[key] = _scalar(key, value, getattr(base, key), src)
    config = _replace(base, _resolve_paths(values, p.parent))
    validate(config, src.path)
    return config


_PATH_KEYS = ("socket_path", "data_dir", "policy_file", "token_file")
_PATH_OPTIONS = ("arena_dir", "tls_ca_file")  # tier options naming files or directories


def _resolve_paths(values: dict[str, Any], base: Path) -> dict[str, Any]:
    """Relative paths in a config file are relative to the file's directory, so a config
    works from any working directory (``policy_file: policies/evicpress.yaml``)."""

    def resolve(path: str) -> str:
        return path if not path or os.path.isabs(path) else str(base / path)

    out = dict(values)
    for key in _PATH_KEYS:
        if key in out:
            out[key] = resolve(out[key])
    if "tls" in out:
        tls = out["tls"]
        out["tls"] = TlsConfig(*(resolve(x) for x in (tls.cert_file, tls.key_file,
                                                        tls.client_ca_file)))  # fmt: skip
    if "model_dirs" in out:
        out["model_dirs"] = tuple(resolve(d) for d in out["model_dirs"])
    if "tenants" in out:
        out["tenants"] = tuple(
            dataclasses.replace(t, token_file=resolve(t.token_file)) for t in out["tenants"]
        )
    if "tiers" in out:
        out["tiers"] = tuple(_resolve_tier(t, resolve) for t in out["tiers"])
    return out


def _resolve_tier(tier: TierConfig, resolve: Callable[[str], str]) -> TierConfig:
    options = dict(tier.options)
    for key in _PATH_OPTIONS:
        if isinstance(options.get(key), str) and options[key] != "memfd":
            options[key] = resolve(options[key])
    return dataclasses.replace(tier, path=resolve(tier.path), options=options)


_TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _tenants(raw: object, src: YamlSource, tier_names: set[str]) -> tuple[TenantConfig, ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"{src.where(('tenants',))}: must be a list of tenants")
    tenants: list[TenantConfig] = []
    for i, t in enumerate(raw):
        at = ("tenants", str(i))
        if not isinstance(t, dict) or "name" not in t:
            raise ConfigError(f"{src.where(at)}: a tenant is a mapping with at least a name")
        _check_keys(t, {"name", "token_file", "quota", "admin", "namespaces"}, src, at)
        name = str(t["name"])
        if not _TENANT_NAME.match(name) or name in {x.name for x in tenants}:
            raise ConfigError(
                f"{src.where((*at, 'name'))}: tenant names are unique, 1-64 of A-Z a-z 0-9 _ . -"
            )
        quotas = _quota(t.get("quota"), src, (*at, "quota"), tier_names)
        spaces = _namespaces(t.get("namespaces") or [], src, (*at, "namespaces"), tier_names)
        tenants.append(
            TenantConfig(
                name, str(t.get("token_file", "")), quotas, bool(t.get("admin", False)), spaces
            )
        )
    return tuple(tenants)


def _quota(
    raw: object, src: YamlSource, at: tuple[str, ...], tier_names: set[str]
) -> dict[str, int]:
    quota = raw or {}
    if not isinstance(quota, dict):
        raise ConfigError(f"{src.where(at)}: a mapping of tier name to size")
    for tier in quota:
        if tier not in tier_names:
            raise ConfigError(
                f"{src.where((*at, str(tier)))}: unknown tier {tier!r}; "
                f"tiers: {', '.join(sorted(tier_names))}"
            )
    return {str(k): parse_size(v, src.where((*at, str(k)))) for k, v in quota.items()}


def _namespaces(
    raw: object, src: YamlSource, at: tuple[str, ...], tier_names: set[str]
) -> tuple[NamespaceConfig, ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"{src.where(at)}: must be a list of namespaces (name, quota)")
    if len(raw) > namespaces.MAX_PER_TENANT:
        raise ConfigError(
            f"{src.where(at)}: {len(raw)} namespaces; a tenant may have at most "
            f"{namespaces.MAX_PER_TENANT}"
        )
    out: list[NamespaceConfig] = []
    for i, n in enumerate(raw):
        here = (*at, str(i))
        if not isinstance(n, dict) or "name" not in n:
            raise ConfigError(
                f"{src.where(here)}: a namespace is a mapping with a name and a quota"
            )
        _check_keys(n, {"name", "quota"}, src, here)
        name = n["name"]
        if not isinstance(name, str) or not namespaces.NAME.fullmatch(name):
            raise ConfigError(
                f"{src.where((*here, 'name'))}: {name!r}: namespace names are "
                f"{namespaces.NAME_RULE}"
            )
        if name in {x.name for x in out}:
            raise ConfigError(f"{src.where((*here, 'name'))}: namespace {name!r} named twice")
        out.append(NamespaceConfig(name, _quota(n.get("quota"), src, (*here, "quota"), tier_names)))
    return tuple(out)


def _metrics_port(value: object, src: YamlSource) -> int | Literal["any"]:
    if value == "any":
        return "any"
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_PORT:
        return value
    raise ConfigError(
        f"{src.where(('metrics_port',))}: expected 0 (off), a port 1-{MAX_PORT} or any "
        f"(any free port, named in the start-up log line), got {value!r}"
    )


def _scalar(key: str, value: object, default: object, src: YamlSource) -> object:
    kind = type(default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        where = src.where((key,))
        raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}")
    return value


def _replace(base: DaemonConfig, values: dict[str, Any]) -> DaemonConfig:
    merged = {f.name: getattr(base, f.name) for f in fields(DaemonConfig)}
    merged.update(values)
    return DaemonConfig(**merged)


def validate(config: DaemonConfig, origin: str = "config") -> None:
    """Cross-field checks: TCP needs TLS and a token; sizes and timeouts are positive."""
    if config.tcp_address and (config.tls is None or not config.token_file):
        raise ConfigError(
            f"{origin}: tcp_address {config.tcp_address!r} requires both tls (cert_file, "
            "key_file) and token_file; the Unix socket needs neither"
        )
    if not 0 < config.lease_s <= MAX_LEASE_S:
        raise ConfigError(f"{origin}: lease_s must be > 0 and at most {MAX_LEASE_S:g} seconds")
    if not 0 < config.allocation_timeout_s < math.inf:
        raise ConfigError(f"{origin}: allocation_timeout_s must be a finite number > 0")
    if not 0 <= config.profile_quiet_s <= MAX_LEASE_S:
        raise ConfigError(
            f"{origin}: profile_quiet_s must be between 0 and {MAX_LEASE_S:g} seconds, got "
            f"{config.profile_quiet_s}"
        )
    if not 0 <= config.compute_threads <= MAX_COMPUTE_THREADS:
        raise ConfigError(
            f"{origin}: compute_threads must be between 0 (half the CPU cores) and "
            f"{MAX_COMPUTE_THREADS}, got {config.compute_threads}"
        )
    if not 0 <= config.shutdown_flush_s <= MAX_LEASE_S:
        raise ConfigError(
            f"{origin}: shutdown_flush_s must be between 0 (no flush) and {MAX_LEASE_S:g} "
            f"seconds, got {config.shutdown_flush_s}"
        )
    if config.health_address and config.health_address.rpartition(":")[0] == "":
        raise ConfigError(
            f"{origin}: health_address must be host:port (e.g. 0.0.0.0:8081, port 0 = any "
            f"free port), got {config.health_address!r}"
        )
    if config.lookup_decision not in LOOKUP_DECISIONS:
        raise ConfigError(
            f"{origin}: lookup_decision must be one of {', '.join(LOOKUP_DECISIONS)}, got "
            f"{config.lookup_decision!r}"
        )
    if config.token_bytes_per_tenant <= 0:
        raise ConfigError(f"{origin}: token_bytes_per_tenant must be > 0")
    if not config.tiers:
        raise ConfigError(f"{origin}: at least one tier is required")
