"""Domain errors, and the one table that maps each to a gRPC status code (:data:`STATUS_OF`):
the server answers with it, the client raises the class back from it, kvtierctl exits by it.

Every error carries a message that names the problem and, where there is a choice, what is
allowed. Code raises these (``raise ... from e`` when wrapping) and never returns sentinels.
"""


class KvtierError(Exception):
    """Base class of every kvtierd error."""


class InvalidArgumentError(KvtierError, ValueError):
    """A request or a configuration value is malformed or out of range."""


class NotFoundError(KvtierError, KeyError):
    """An object, context, lease, allocation or tier does not exist (or no longer exists)."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it as written
        return str(self.args[0]) if self.args else ""


class AlreadyExistsError(KvtierError):
    """An object with this key is already committed, or an allocation was already committed."""


class CapacityError(KvtierError):
    """No tier can hold the object (larger than any tier, arena full, quota exhausted)."""


class StorageFullError(CapacityError):
    """The device behind a tier has no space left (e.g. ENOSPC on the SSD)."""


class CorruptObjectError(KvtierError):
    """Stored bytes fail their checksum or header check; the object is quarantined, not served."""


class SolverError(KvtierError):
    """An optimisation solver (HiGHS) gave up on a valid problem; the message names its status."""


class LeaseError(KvtierError):
    """A lease is unknown, expired, or belongs to a previous daemon incarnation."""


class UnavailableError(KvtierError):
    """A tier or the daemon is draining, closed or unreachable; the caller may retry later."""


class PermissionDeniedError(KvtierError):
    """The caller may not touch this object (another tenant's) or presented no valid token."""


class UnauthenticatedError(PermissionDeniedError):
    """No credentials, or credentials the daemon does not know."""


class ConfigError(InvalidArgumentError):
    """A configuration file is invalid; the message names the file, line, key and allowed values."""


# Most specific first: the first class an error is an instance of decides its status.
STATUS_OF: tuple[tuple[type[KvtierError], str], ...] = (
    (UnauthenticatedError, "UNAUTHENTICATED"),
    (ConfigError, "INVALID_ARGUMENT"),
    (InvalidArgumentError, "INVALID_ARGUMENT"),
    (NotFoundError, "NOT_FOUND"),
    (AlreadyExistsError, "ALREADY_EXISTS"),
    (CapacityError, "RESOURCE_EXHAUSTED"),
    (CorruptObjectError, "DATA_LOSS"),
    (LeaseError, "FAILED_PRECONDITION"),
    (UnavailableError, "UNAVAILABLE"),
    (PermissionDeniedError, "PERMISSION_DENIED"),
    (KvtierError, "INTERNAL"),
)


def status_name(error: BaseException) -> str:
    """The gRPC status (by name) an error is answered with; ``INTERNAL`` for any other."""
    return next((name for cls, name in STATUS_OF if isinstance(error, cls)), "INTERNAL")


def error_class(status: str) -> type[KvtierError]:
    """The class a client raises for a status: the most general one the table maps to it."""
    return next((cls for cls, name in reversed(STATUS_OF) if name == status), KvtierError)
