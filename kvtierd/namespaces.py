"""Namespaces inside a tenant (issue 41.2): the key syntax that names one.

A key (or context id) that begins ``ns:<name>:`` belongs to namespace ``<name>`` of its
tenant; the LMCache plugin builds such keys for a request whose ``cache_salt`` names a
namespace (``integrations/salt.py``). The daemon charges an object to its namespace only if
the tenant's YAML configures it (``tenants[].namespaces``): any other key, whatever it says, is
charged to the tenant itself, so that a client cannot make namespaces (metric labels, usage
rows) the operator did not configure.
"""

from __future__ import annotations

import re

PREFIX = "ns:"
SEPARATOR = ":"
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A namespace's name: 1-64 of ``A-Z a-z 0-9 _ . -`` (a tenant's name's alphabet)."""
NAME_RULE = "1-64 of A-Z a-z 0-9 _ . -"
MAX_PER_TENANT = 256
"""The most namespaces one tenant may configure (each is a usage row and metric labels)."""


def named_in(key: str) -> str:
    """The namespace a (tenant-unscoped) key names, ``""`` for none: ``ns:<name>:...``."""
    if not key.startswith(PREFIX):
        return ""
    name, sep, _ = key[len(PREFIX) :].partition(SEPARATOR)
    return name if sep and NAME.fullmatch(name) else ""


def prefix(name: str) -> str:
    """The key prefix of namespace ``name`` (a valid name)."""
    if not NAME.fullmatch(name):
        raise ValueError(f"namespace {name!r}: names are {NAME_RULE}")
    return f"{PREFIX}{name}{SEPARATOR}"
