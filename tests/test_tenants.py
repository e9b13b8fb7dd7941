"""Tenants: the keys file, its reload, the per-tenant limits and usage counters."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tokenmill.gateway.tenant_gate import TenantGate, TenantLimited
from tokenmill.entrypoints.server.tenant_usage import TenantUsage
from tokenmill.gateway.tenants import (DEFAULT_TENANT, Tenant, TenantDirectory, TenantLimits, TenantTable,
                                           hash_key)


def keys_file(tmp_path, tenants, keys, name="keys.yaml"):
    path = tmp_path / name
    data = {"tenants": tenants, "keys": [{"sha256": hash_key(k), "tenant": t} for k, t in keys.items()]}
    path.write_text(json.dumps(data))  # JSON is YAML too
    return str(path)


def test_keys_map_to_tenants_and_plain_api_keys_to_the_default(tmp_path):
    path = keys_file(tmp_path, {"chat": {"priority_class": "high", "weight": 4, "tokens_per_minute": 1000},
                                "batch": {"class": 4}}, {"k-chat": "chat", "k-batch": "batch"})
    directory = TenantDirectory(path, ["operator"])
    chat = directory.lookup("k-chat")
    assert chat == Tenant("chat", 1, 4.0, TenantLimits(tokens_per_minute=1000))
    assert directory.lookup("k-batch").priority_class == 4
    # an --api-key key is the default tenant, marked as the operator; a keys-file key never is
    assert directory.lookup("operator") == replace(DEFAULT_TENANT, operator=True)
    assert not chat.operator
    assert directory.lookup("wrong") is None and directory.lookup("") is None
    assert directory.names() == ["default", "batch", "chat"]
    assert directory.label("chat") == "chat" and directory.label("made-up") == "other"


def test_the_file_stores_hashes_only(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("tenants: {a: {}}\nkeys:\n  - {sha256: secret-key, tenant: a}\n")
    with pytest.raises(ValueError, match="64 hex digits"):
        TenantTable.load(str(path))


@pytest.mark.parametrize("bad, match", [
    ({"tenants": {"a": {"weight": 0}}}, "weight"),
    ({"tenants": {"a": {"priority_class": "urgent"}}}, "priority class"),
    ({"tenants": {"a": {"max_inflight": -1}}}, "max_inflight"),
    ({"tenants": {"a": {"colour": "red"}}}, "unknown field"),
    ({"tenants": {"other": {}}}, "reserved"),
    ({"tenants": {}, "keys": [{"sha256": "0" * 64, "tenant": "ghost"}]}, "does not list"),
    ({"tenant": {}}, "unknown section"),
])
def test_bad_files_are_refused_with_the_reason(bad, match):
    with pytest.raises(ValueError, match=match):
        TenantTable.parse(bad)


def test_reload_swaps_the_table_and_keeps_it_when_the_new_file_is_bad(tmp_path):
    path = keys_file(tmp_path, {"a": {}}, {"k1": "a"})
    directory = TenantDirectory(path)
    assert directory.lookup("k1").name == "a"
    keys_file(tmp_path, {"b": {"weight": 2}}, {"k2": "b"})
    assert directory.reload()
    assert directory.lookup("k1") is None and directory.lookup("k2").weight == 2
    (tmp_path / "keys.yaml").write_text("tenants: [")
    assert not directory.reload()
    assert directory.lookup("k2").name == "b"


def test_inflight_and_queue_limits_refuse_only_past_them():
    gate = TenantGate(retry_after_s=2)
    t = Tenant("t", limits=TenantLimits(max_inflight=2, max_queued=3))
    gate.admit(t, 1, 2, 10)
    gate.admit(t, 1, 1, 10)
    with pytest.raises(TenantLimited) as exc:
        gate.admit(t, 1, 1, 10)
    assert exc.value.code == "tenant_inflight_limit" and exc.value.retry_after_s == 2
    gate.finished(t, 1, 0)
    with pytest.raises(TenantLimited, match="queued"):
        gate.admit(t, 1, 1, 10)  # 3 sequences queued still
    gate.started("t", 2)
    gate.admit(t, 1, 1, 10)
    gate.admit(DEFAULT_TENANT, 100, 100, 10 ** 9)  # others are not limited


def test_tokens_per_minute_bucket_refills_and_refunds_unused_output():
    now = [0.0]
    gate = TenantGate(clock=lambda: now[0])
    t = Tenant("t", limits=TenantLimits(tokens_per_minute=600))  # 10 tokens a second
    gate.admit(t, 1, 1, 500)
    with pytest.raises(TenantLimited) as exc:
        gate.admit(t, 1, 1, 200)
    assert exc.value.code == "tenant_token_rate_limit" and exc.value.retry_after_s == 10  # 100 short
    gate.finished(t, 1, 300)  # used 200 of the 500 held
    gate.admit(t, 1, 1, 350)
    now[0] = 30.0  # 300 tokens back
    gate.admit(t, 1, 1, 350)
    # bigger than the whole bucket: needs it full, then leaves it in debt
    now[0] = 1000.0
    gate.admit(t, 1, 1, 5000)
    with pytest.raises(TenantLimited):
        gate.admit(t, 1, 1, 1)


def test_usage_labels_are_bounded_and_exposed():
    usage = TenantUsage(lambda name: name if name in ("default", "a") else "other", lambda: ["default", "a"],
                        labelled=True)
    usage.record("a", 10, 4, 7, 0.5, False)
    usage.record("intruder-1", 3, 0, 1, 0.0, True)
    usage.record("intruder-2", 3, 0, 1, 0.0, False)
    snap = usage.snapshot()
    assert set(snap) == {"default", "a", "other"}
    assert snap["a"]["prompt_tokens"] == 10 and snap["a"]["cached_tokens"] == 4 and snap["a"]["output_tokens"] == 7
    assert snap["other"]["requests"] == 2 and snap["other"]["errors"] == 1
    assert usage.snapshot("a") == {"a": snap["a"]}
    families = {f.name: f for f in usage.collect()}
    samples = {s.labels["tenant"]: s.value for s in families["tokenmill:tenant_output_tokens"].samples
               if s.name.endswith("_total")}
    assert samples == {"default": 0, "a": 7, "other": 2}


def test_usage_series_name_no_tenant_unless_labelled():
    """/metrics needs no key: by default its usage series are one sum per counter, no tenant names."""
    usage = TenantUsage(lambda name: name, lambda: ["default", "secret-team"])
    usage.record("secret-team", 10, 4, 7, 0.5, False)
    usage.record("default", 3, 0, 1, 0.0, True)
    families = {f.name: f for f in usage.collect()}
    samples = [s for s in families["tokenmill:tenant_output_tokens"].samples if s.name.endswith("_total")]
    assert [(s.labels, s.value) for s in samples] == [({}, 8)]
    assert all("tenant" not in s.labels for f in families.values() for s in f.samples)
    assert set(usage.snapshot()) == {"default", "secret-team"}  # /v1/usage still has them by name


DEEP_JSON = '{"tenants": {"a": {}}, "keys": ' + "[" * 100000 + "]" * 100000 + "}"
DEEP_YAML = "tenants: {a: {}}\nkeys: " + "[" * 100000 + "]" * 100000 + "\n"
DEEP_BLOCK_YAML = "tenants: {a: {}}\nkeys:\n" + "".join("  " * i + "-\n" for i in range(2000))
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")) + "tenants: *i\n"


@pytest.mark.parametrize("name, text, match", [
    ("keys.json", DEEP_JSON, "nested deeper"),
    ("keys.yaml", DEEP_YAML, "nested deeper|nesting depth"),  # libyaml may refuse it first
    ("keys.yaml", DEEP_BLOCK_YAML, "nested deeper"),
    ("keys.yaml", ALIAS_BOMB, "aliases"),
    ("keys.yaml", "tenants: [\n", "not valid YAML"),
    ("keys.json", "[1, 2", "not valid JSON"),
    ("keys.yaml", "tenants: {a: {weight: !!python/name:os.system}}\n", "not valid YAML"),
    ("keys.yaml", "- just\n- a list\n", "expected a mapping"),
    ("keys.json", '{"tenants": {"a": {"max_inflight": ' + "9" * 5000 + "}}}", "not valid JSON"),
])
def test_a_hostile_or_broken_file_is_a_value_error_and_a_reload_keeps_the_old_table(tmp_path, name, text, match):
    path = keys_file(tmp_path, {"a": {}}, {"k1": "a"}, name=name)
    directory = TenantDirectory(path)
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=match):
        TenantTable.load(path)
    assert not directory.reload() and directory.reload_failures == 1
    assert directory.lookup("k1").name == "a"


def test_a_file_past_the_size_bound_is_refused_unread(tmp_path, monkeypatch):
    import tokenmill.gateway.tenants as tenants

    path = keys_file(tmp_path, {"a": {}}, {"k1": "a"})
    monkeypatch.setattr(tenants, "MAX_FILE_BYTES", 64)
    with pytest.raises(ValueError, match="larger than 64 bytes"):
        TenantTable.load(path)


def test_a_router_key_is_neither_an_operator_key_nor_a_tenant_key(tmp_path):
    path = keys_file(tmp_path, {"a": {}}, {"k1": "a"})
    with pytest.raises(ValueError, match="differ from every --api-key"):
        TenantDirectory(path, ["same"], ["same"])
    with pytest.raises(ValueError, match="tenant's key"):
        TenantDirectory(path, ["operator"], ["k1"])
    directory = TenantDirectory(path, ["operator"], ["router"])
    assert directory.lookup("router") == DEFAULT_TENANT and directory.is_router("router")
    assert not directory.is_router("operator") and not directory.is_router("k1")
    keys_file(tmp_path, {"a": {}}, {"router": "a"})  # a reload cannot make the router key a tenant's
    assert not directory.reload() and directory.is_router("router") and directory.lookup("k1").name == "a"
