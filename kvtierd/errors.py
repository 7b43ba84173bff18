"""Domain errors. The server maps each class to one gRPC status code in one interceptor.

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
