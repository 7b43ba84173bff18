"""Who is calling: a tenant (a namespace of keys and contexts) and whether it may use Admin.

The Unix socket is trusted (mode 0600: only the daemon's user can connect), so a caller there
names its tenant in the ``x-kvtierd-tenant`` metadata and is an admin. On TCP the bearer
token decides: the daemon's ``token_file`` is the admin of the default tenant, each tenant's
``token_file`` identifies that tenant. Servicers read the caller from :data:`CALLER`.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from kvtierd.config import DaemonConfig
from kvtierd.errors import ConfigError, PermissionDeniedError, UnauthenticatedError

TENANT_METADATA = "x-kvtierd-tenant"
SEPARATOR = "/"


@dataclass(frozen=True, slots=True)
class Caller:
    """``tenant`` ``""`` is the default tenant, whose names are the daemon-wide names; so that
    it cannot reach into a named tenant's namespace (``A/secret``, or plant ``A/...`` keys in
    it), a name of its that begins with a configured tenant's name and ``/`` is refused
    (``tenants``: those names)."""

    tenant: str = ""
    admin: bool = True
    tenants: frozenset[str] = frozenset()

    def scoped(self, name: str) -> str:
        """The daemon-wide name of a tenant's key or context id."""
        if self.tenant:
            return f"{self.tenant}{SEPARATOR}{name}" if name else name
        owner, sep, _ = name.partition(SEPARATOR)
        if sep and owner in self.tenants:
            raise PermissionDeniedError(
                f"{name!r} is in tenant {owner!r}'s namespace: the default tenant may not use "
                f"keys or context ids that begin with a tenant's name and {SEPARATOR!r}"
            )
        return name

    def scoped_all(self, names: Iterable[str]) -> list[str]:
        """:meth:`scoped` of each name (a Lookup's keys: up to thousands a call). The default
        tenant with no tenants configured, the common case, keeps every name as it is."""
        if not self.tenant and not self.tenants:
            return list(names)
        return [self.scoped(name) for name in names]

    def unscoped(self, name: str) -> str:
        prefix = f"{self.tenant}{SEPARATOR}"
        return name[len(prefix) :] if self.tenant and name.startswith(prefix) else name


CALLER: ContextVar[Caller] = ContextVar("kvtierd_caller", default=Caller())  # noqa: B039 (frozen)

Metadata = Sequence[tuple[str, str | bytes]] | None


def _read_token(path: str, what: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read {what} token_file {path}: {e.strerror}") from e
    if not token:
        raise ConfigError(f"{what} token_file {path} is empty")
    return token


class Identities:
    def __init__(self, config: DaemonConfig) -> None:
        self.tenants = frozenset(t.name for t in config.tenants)
        self._tokens: list[tuple[bytes, Caller]] = []
        if config.token_file:
            daemon = Caller(tenants=self.tenants)
            self._tokens.append((_read_token(config.token_file, "daemon").encode(), daemon))
        for t in config.tenants:
            if t.token_file:
                token = _read_token(t.token_file, f"tenant {t.name!r}").encode()
                self._tokens.append((token, Caller(t.name, t.admin)))

    def _tenant(self, name: str) -> str:
        if name and name not in self.tenants:
            known = ", ".join(sorted(self.tenants)) or "none configured"
            raise PermissionDeniedError(f"unknown tenant {name!r}; tenants: {known}")
        return name

    def unix(self, metadata: Metadata) -> Caller:
        given = dict(metadata or ()).get(TENANT_METADATA, "")
        tenant = given.decode() if isinstance(given, bytes) else given
        return Caller(self._tenant(tenant), admin=True, tenants=self.tenants)

    def tcp(self, metadata: Metadata) -> Caller:
        header = dict(metadata or ()).get("authorization", "")
        given = header.encode() if isinstance(header, str) else header
        for token, caller in self._tokens:
            # compare_digest on every token: timing does not tell which one almost matched
            if hmac.compare_digest(given, b"Bearer " + token):
                return caller
        raise UnauthenticatedError(
            "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"
        )
