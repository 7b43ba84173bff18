"""A Lookup scopes its keys in one pass (``Caller.scoped_all``): the same names, and the same
refusal, as :meth:`Caller.scoped` gives one name at a time."""

from __future__ import annotations

import pytest

from kvtierd.errors import PermissionDeniedError
from kvtierd.server.identity import Caller

NAMES = ["k1", "", "a/b", "team/x", "team"]


@pytest.mark.parametrize(
    "caller",
    [Caller(), Caller("team"), Caller(tenants=frozenset({"other"})), Caller("t", False)],
    ids=["default", "tenant", "default-with-tenants", "tenant-not-admin"],
)
def test_scoped_all_is_scoped_of_each_name(caller: Caller) -> None:
    assert caller.scoped_all(iter(NAMES)) == [caller.scoped(n) for n in NAMES]


def test_the_default_tenant_may_not_name_a_tenants_keys_in_one_pass_either() -> None:
    caller = Caller(tenants=frozenset({"team"}))
    with pytest.raises(PermissionDeniedError, match="'team'"):
        caller.scoped("team/x")
    with pytest.raises(PermissionDeniedError, match="'team'"):
        caller.scoped_all(["k1", "team/x"])
    assert caller.scoped_all(["k1", "other/x"]) == ["k1", "other/x"]
