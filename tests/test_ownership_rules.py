"""The ownership rules on their own (fast): who the operator is, the one owner check, the
response store asking it, the adapter path allow-list, and adapter_config.json's bounds."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.entrypoints.server.adapter_paths import allowed_adapter_path
from tokenmill.entrypoints.openai.response_store import ResponseStore, StoredResponse
from tokenmill.model.lora.lora import CONFIG_MAX_DEPTH, LoraError, ModelShape, build_weights, nesting_depth, parse_config
from tokenmill.gateway.tenants import (DEFAULT_TENANT, FAIRNESS_HEADER, Tenant, TenantDirectory, hash_key, is_operator,
                               may_access, may_use, owner_of, parse_tenant)

NAMES = st.sampled_from(["default", "alice", "bob", "other"])
OPERATOR = replace(DEFAULT_TENANT, operator=True)


@given(NAMES, NAMES, st.booleans())
def test_one_owner_check(caller_name, owner_name, caller_is_operator):
    caller = Tenant(caller_name, operator=caller_is_operator)
    owner = owner_of(Tenant(owner_name))
    assert owner == owner_name  # a tenant's object records its name
    assert may_access(caller, owner) == (caller_is_operator or caller_name == owner_name)
    # the operator's objects (owner None): no tenant reaches them, not even one named "default";
    # to use (adapters) they are everyone's
    assert may_access(caller, None) == caller_is_operator
    assert may_use(caller, None) and may_use(caller, owner) == may_access(caller, owner)
    assert may_access(None, owner) and is_operator(None) and owner_of(None) is None and owner_of(OPERATOR) is None


def test_the_operator_is_an_api_key_and_a_router_speaking_for_a_tenant_is_that_tenant(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {"alice": {}}, "keys": [
        {"sha256": hash_key("k-alice"), "tenant": "alice"}, {"sha256": hash_key("k-default"), "tenant": "default"}]}))
    directory = TenantDirectory(str(path), ["op"], ["router"])
    op, alice, keyed_default = directory.lookup("op"), directory.lookup("k-alice"), directory.lookup("k-default")
    assert is_operator(op) and not is_operator(alice) and not is_operator(keyed_default)
    # only the router key names a tenant, and the tenant it names is never the operator
    assert not any(directory.is_router(k) for k in ("op", "k-alice", "k-default"))
    assert not is_operator(directory.lookup("router"))
    spoken = directory.delegated({FAIRNESS_HEADER: b"alice"})
    assert spoken.name == "alice" and not is_operator(spoken)
    assert not is_operator(directory.delegated({}))  # a router speaking for nobody is the default tenant


def test_the_store_hides_entries_from_all_but_their_owner_and_the_operator():
    alice, bob = Tenant("alice"), Tenant("bob")
    store = ResponseStore(2)
    store.put("a", StoredResponse({"id": "a"}, [], owner_of(alice)))
    store.put("o", StoredResponse({"id": "o"}, [], owner_of(OPERATOR)))
    assert store.get("a", caller=bob) is None and not store.delete("a", caller=bob)
    assert store.get("o", caller=alice) is None and store.get("o", caller=Tenant("default")) is None
    assert store.get("a", caller=alice) is not None and store.get("a", caller=OPERATOR) is not None
    # bob's lookups do not count as use: "o" stays the most recent after them
    assert store.get("o", caller=OPERATOR) is not None
    store.get("a", caller=bob)
    store.put("n", StoredResponse({"id": "n"}, []))
    assert store.get("a", caller=OPERATOR) is None and store.get("o", caller=OPERATOR) is not None
    assert store.delete("o", caller=OPERATOR) and store.get("o", caller=OPERATOR) is None


def test_adapter_dirs_are_absolute_folders():
    assert parse_tenant("t", {"adapter_dirs": ["/srv/a/", "/srv/b"]}).adapter_dirs == ("/srv/a", "/srv/b")
    assert parse_tenant("t", {}).adapter_dirs == ()
    for bad in (["relative/dir"], [""], [3], {"a": 1}):
        with pytest.raises(ValueError, match="adapter_dirs"):
            parse_tenant("t", {"adapter_dirs": bad})
    with pytest.raises(ValueError, match="unknown field"):
        parse_tenant("t", {"operator": True})  # the keys file cannot make a tenant the operator


def _adapter(folder) -> str:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.safetensors").write_bytes(b"x")
    return str(folder)


@pytest.fixture
def tree(tmp_path):
    """allowed/{good, sub/deep, link_in -> good, link_out -> outside, leaky (weights -> outside)}
    and outside/secret, another tenant's adapter."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    _adapter(allowed / "good")
    _adapter(allowed / "sub" / "deep")
    secret = _adapter(outside / "secret")
    os.symlink(allowed / "good", allowed / "link_in")
    os.symlink(secret, allowed / "link_out")
    leaky = allowed / "leaky"
    leaky.mkdir()
    (leaky / "adapter_config.json").write_text("{}")
    os.symlink(os.path.join(secret, "adapter_model.safetensors"), leaky / "adapter_model.safetensors")
    (allowed / "empty").mkdir()
    return tmp_path


def test_the_allow_list_by_example(tree):
    dirs = [str(tree / "allowed")]
    real = os.path.realpath(tree / "allowed" / "good")
    assert allowed_adapter_path("good", dirs) == real
    assert allowed_adapter_path(str(tree / "allowed" / "good"), dirs) == real
    assert allowed_adapter_path("link_in", dirs) == real  # a link that stays inside is the file it names
    assert allowed_adapter_path("sub/deep", dirs) == os.path.realpath(tree / "allowed" / "sub" / "deep")
    for refused in ("link_out", "leaky", "empty", "missing", "../outside/secret", "sub/../good",
                    str(tree / "outside" / "secret"), str(tree / "allowed" / ".." / "outside" / "secret"),
                    "/etc", "/", "", "good\x00", str(tree)):
        assert allowed_adapter_path(refused, dirs) is None, refused
    assert allowed_adapter_path("good", []) is None  # no folders: nothing
    assert allowed_adapter_path("good", ["relative"]) is None


SEGMENTS = st.sampled_from(["..", ".", "good", "sub", "deep", "link_in", "link_out", "leaky", "outside", "secret",
                            "allowed", "", "missing"])


@settings(max_examples=200, deadline=None)
@given(st.lists(SEGMENTS, max_size=6), st.booleans())
def test_whatever_the_path_the_answer_lies_inside(tmp_path_factory, segments, absolute):
    tree = tmp_path_factory.getbasetemp() / "allow_tree"
    if not tree.exists():
        _adapter(tree / "allowed" / "good")
        _adapter(tree / "allowed" / "sub" / "deep")
        secret = _adapter(tree / "outside" / "secret")
        os.symlink(tree / "allowed" / "good", tree / "allowed" / "link_in")
        os.symlink(secret, tree / "allowed" / "link_out")
    root = os.path.realpath(tree / "allowed")
    given_path = "/".join(segments)
    if absolute:
        given_path = str(tree) + "/" + given_path
    got = allowed_adapter_path(given_path, [str(tree / "allowed")])
    if got is not None:
        assert os.path.commonpath([got, root]) == root
        assert os.path.isfile(os.path.join(got, "adapter_config.json"))
        assert ".." not in segments


def _nested(depth: int, opener: str) -> str:
    closer = {"[": "]", "{": "}"}[opener]
    inner = "1"
    for _ in range(depth):
        inner = f'{opener}{inner}{closer}' if opener == "[" else '{"k": ' + inner + "}"
    return '{"r": 4, "x": ' + inner + "}"


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 5000), st.sampled_from(["[", "{"]))
def test_adapter_config_depth_is_bounded_before_parsing(depth, opener):
    text = _nested(depth, opener)
    if depth + 1 <= CONFIG_MAX_DEPTH:
        assert parse_config(text.encode())["r"] == 4
    else:
        with pytest.raises(LoraError, match="nested deeper"):
            parse_config(text.encode())


def test_adapter_config_bounds_and_shapes():
    assert nesting_depth('{"a": "[[[[{{{{\\"]]]"}') == 1  # brackets and escaped quotes in strings: no depth
    with pytest.raises(LoraError, match="larger than"):
        parse_config(b'{"r": 4, "pad": "' + b"x" * (1 << 20) + b'"}')
    with pytest.raises(LoraError, match="nested deeper"):
        parse_config(b"[" * 1_000_000)  # would be RecursionError in the parser
    for bad, words in ((b"\xff\xfe", "UTF-8"), (b"[1, 2]", "not a JSON object"), (b"{", "not valid JSON")):
        with pytest.raises(LoraError, match=words):
            parse_config(bad)


def test_nan_and_inf_weights_are_refused():
    shape = ModelShape(num_layers=1, hidden=8, q_size=8, kv_size=4, intermediate=16, num_heads=2)
    for poison in (float("nan"), float("inf"), float("-inf")):
        a, b = torch.zeros(2, 8), torch.zeros(8, 2)
        a[1, 3] = poison
        with pytest.raises(LoraError, match="NaN or infinite"):
            build_weights("x", 1, shape, 2, 1.0, {(0, "q_proj"): {"A": a, "B": b}}, "")
    weights = build_weights("x", 1, shape, 2, 1.0, {(0, "q_proj"): {"A": torch.zeros(2, 8), "B": torch.zeros(8, 2)}},
                            "")
    assert weights.rank == 2
