"""Issue 16 (4): YAML from a user — a policy sent with ApplyPolicy, a daemon config file — is
loaded without alias expansion: a 248-byte "billion laughs" policy took 21 s and 1.3 GB, a
slightly larger one blocked every other call and got the daemon killed for memory."""

from __future__ import annotations

import time

import pytest

from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.config import load_daemon_config
from kvtierd.policies.loader import parse_policy
from kvtierd.rpc import kvtier_pb2 as pb


def _bomb(levels: int = 9) -> str:
    lines = ["placer: lru", 'a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, levels):
        prev = f"*a{i - 1}"
        lines.append(f"a{i}: &a{i} [{', '.join([prev] * 9)}]")
    lines.append(f"description: *a{levels - 1}")
    return "\n".join(lines) + "\n"


def test_apply_policy_refuses_an_alias_bomb_at_once(start_daemon):
    d = start_daemon()
    bomb = _bomb()
    assert len(bomb) < 600
    with KVClient(d.socket_path, timeout_s=10) as c:
        started = time.monotonic()
        with pytest.raises(errors.InvalidArgumentError, match=r"aliases \(\*a0\) are not allowed"):
            c.call(c.admin.ApplyPolicy, pb.ApplyPolicyRequest(yaml=bomb, source="bomb.yaml"))
        assert time.monotonic() - started < 2.0
        assert c.call(c.admin.GetPolicy, pb.PolicyRequest()).name == "lru"  # unchanged
        assert c.status().health == "SERVING"


def test_policy_and_config_refuse_aliases_depth_and_size(tmp_path):
    with pytest.raises(errors.ConfigError, match="aliases"):
        parse_policy("placer: &p lru\nname: *p\n", "p.yaml")
    with pytest.raises(errors.ConfigError, match="nested too deeply"):
        parse_policy("placer: lru\ndescription: " + "[" * 5000 + "]" * 5000 + "\n", "deep.yaml")
    with pytest.raises(errors.ConfigError, match="larger than 1048576 bytes"):
        parse_policy("placer: lru\n" + "#" * (1 << 20) + "\n", "big.yaml")
    config = tmp_path / "kvtierd.yaml"
    config.write_text("lease_s: &l 5.0\nallocation_timeout_s: *l\n")
    with pytest.raises(errors.ConfigError, match=f"{config}: not valid YAML.*aliases"):
        load_daemon_config(config)


def test_characters_yaml_refuses_are_a_config_error():
    """Found by the fuzzer once the loader was replaced: the reader raised before the parse
    was guarded, and ApplyPolicy answered INTERNAL."""
    with pytest.raises(errors.ConfigError, match="not valid YAML"):
        parse_policy("placer: lru\ndescription: \x94\n", "p.yaml")


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    """YAML's loaders keep a repeated key's last value silently: a policy or config that says a
    setting twice lost the first without a word."""
    with pytest.raises(
        errors.ConfigError, match=r"p.yaml:3: placer: duplicate key \(first at line 1\)"
    ):
        parse_policy("placer: lru\nname: x\nplacer: evicpress\n", "p.yaml")
    with pytest.raises(errors.ConfigError, match=r"p.yaml:4: profiling.min_queries: duplicate key"):
        parse_policy(
            "placer: evicpress\nprofiling:\n  min_queries: 1\n  min_queries: 2\n", "p.yaml"
        )
    config = tmp_path / "kvtierd.yaml"
    config.write_text("lease_s: 5.0\nlease_s: 6.0\n")
    with pytest.raises(errors.ConfigError, match=f"{config}:2: lease_s: duplicate key"):
        load_daemon_config(config)
