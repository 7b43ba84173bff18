"""Issue 40's "checked without a finding (keep them so)": what a hostile tenant tried and the
daemon refused or ignored, kept as tests against one real daemon with tenants ``a`` and ``b``.

Covered elsewhere, not repeated here: a child naming another tenant's parent
(``test_context_tree.py::test_another_tenants_context_is_no_parent``); the default tenant's
get / lookup / put / delete of ``a/...`` (``test_tenants.py::
test_the_default_tenant_cannot_enter_a_named_tenants_namespace``); a report's reporter name
and upper bound from the default tenant (``test_profile_schedule.py::
test_a_report_is_validated_and_scoped``).

One daemon serves the module (each test uses its own names): a start per test would cost more
than the tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from benchmarks._support.daemon_proc import DaemonProcess, write_config
from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.engine.in_flight_reports import MAX_IN_FLIGHT
from kvtierd.rpc import kvtier_pb2 as pb

CHUNK = np.ones(4096, np.uint8)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    directory = tmp_path_factory.mktemp("tenant-checks")
    config = write_config(
        directory, cpu="16MiB", ssd="64MiB", tenants=[{"name": "a"}, {"name": "b"}]
    )
    d = DaemonProcess(config, str(directory / "kvtierd.sock"), directory / "daemon.log",
                      given_bandwidths=True)  # fmt: skip
    d.start()
    yield d
    d.kill()


@pytest.fixture
def clients(daemon: DaemonProcess) -> Iterator[tuple[KVClient, KVClient, KVClient]]:
    """(tenant a, tenant b, the default tenant)."""
    with (
        KVClient(daemon.socket_path, tenant="a") as a,
        KVClient(daemon.socket_path, tenant="b") as b,
        KVClient(daemon.socket_path) as default,
    ):
        yield a, b, default


def _contexts(default: KVClient) -> dict[str, tuple[str, int]]:
    """Every tenant's contexts (the default tenant is the admin): id -> (parent, objects)."""
    return {c.context_id: (c.parent_context_id, c.objects) for c in default.contexts()}


def _put_prompt(c: KVClient, keys: list[str]) -> str:
    advice = c.advise(keys[0], len(keys) * 256, len(keys) * CHUNK.size)
    for key in keys:
        c.put(key, CHUNK, context_id=advice.context_id)
    return advice.context_id


def test_advise_after_another_tenants_key_splits_nothing(clients) -> None:
    a, b, default = clients
    doc = _put_prompt(a, ["adv-s0", "adv-s1", "adv-s2"])
    before = _contexts(default)
    # b names a's middle chunk as the one before its put: b/adv-s1 is no key of b's
    advice = b.advise("b-doc", 256, CHUNK.size, after_key="adv-s1")
    assert (advice.context_id, advice.parent_context_id) == ("b-doc", "")
    assert _contexts(default) == before  # a's context not split, no child made
    assert before[f"a/{doc}"] == ("", 3)


def test_queries_and_tokens_for_another_tenants_context_are_not_found(clients) -> None:
    a, b, _ = clients
    a.put("qt-k", CHUNK, context_id="qt-doc")
    with pytest.raises(errors.NotFoundError, match="'qt-doc' not found"):
        b.call(b.kv.AddQueries, pb.AddQueriesRequest(context_id="qt-doc", texts=["what?"]))
    with pytest.raises(errors.NotFoundError, match="'qt-doc' not found"):
        b.set_context_tokens("qt-doc", [1, 2, 3])
    b.note_prompt("qt-r", [1, 2, 3])  # its own prompt, linked to a's context: refused
    with pytest.raises(errors.NotFoundError, match="'qt-doc' not found"):
        b.link_prompt("qt-doc", "qt-r")
    # a's own calls are accepted: the refusals are about the owner, not the requests
    a.call(a.kv.AddQueries, pb.AddQueriesRequest(context_id="qt-doc", texts=["what?"]))
    a.set_context_tokens("qt-doc", [1, 2, 3])


def test_the_default_tenant_cannot_name_a_tenants_context(clients) -> None:
    a, _, default = clients
    a.put("dt-k", CHUNK, context_id="dt-doc")
    denied = errors.PermissionDeniedError
    with pytest.raises(denied, match=r"tenant 'a'.s namespace"):
        default.advise("a/dt-doc", 256, CHUNK.size)
    with pytest.raises(denied):
        default.advise("mine", 256, CHUNK.size, after_key="a/dt-k")
    with pytest.raises(denied):
        default.call(
            default.kv.AddQueries, pb.AddQueriesRequest(context_id="a/dt-doc", texts=["q"])
        )
    with pytest.raises(denied):
        default.set_context_tokens("a/dt-doc", [1, 2])
    with pytest.raises(denied):
        default.touch(["a/dt-k"])
    with pytest.raises(denied):
        default.put("k", CHUNK, context_id="mine", parent_context_id="a/dt-doc")


def test_in_flight_reports_are_bounded_for_every_tenant(clients) -> None:
    a, b, _ = clients
    for c in (a, b):
        assert c.report_in_flight("router-1", MAX_IN_FLIGHT) > 0
        assert c.report_in_flight("router-1", 0) > 0
        for count in (MAX_IN_FLIGHT + 1, 2**32 - 1):  # the field is a uint32
            with pytest.raises(errors.InvalidArgumentError, match="in_flight must be between"):
                c.report_in_flight("router-1", count)
        for reporter in ("", "a/b", "r" * 65, "b/../x"):
            with pytest.raises(errors.InvalidArgumentError, match="reporter must be"):
                c.report_in_flight(reporter, 1)


def test_an_advise_of_ten_thousand_unknown_contexts_answers_and_stores_nothing(clients) -> None:
    _, b, default = clients
    before = _contexts(default)
    queries = [pb.AdviseQuery(context_id=f"unknown-{i}", num_tokens=256, size_bytes=4096)
               for i in range(10_000)]  # fmt: skip
    advice = b.call(b.kv.Advise, pb.AdviseRequest(contexts=queries)).advice
    assert [w.context_id for w in advice] == [q.context_id for q in queries]
    assert not any(w.parent_context_id for w in advice)
    assert _contexts(default) == before  # advice is no put: nothing held for them
