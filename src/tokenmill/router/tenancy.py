"""Tenants at the router: who sends a request, how much it matters, and the tenant's
limits across every replica.

The Gateway API Inference Extension names two request headers:

- ``x-gateway-inference-objective``: the name of an InferenceObjective, which
  carries an integer priority (higher first; below zero means the request may be
  shed). ``tokenmill route --objective NAME=PRIORITY`` gives the table; a class
  name of the keys file (``critical``, ``high``, ``normal``, ``low``, ``batch``)
  or an integer also works, and anything else counts as 0.
- ``x-gateway-inference-fairness-id``: the flow (tenant) the request is fair
  against.

With ``--api-keys-file`` (the servers' file, gateway/tenants.py) the router knows the
tenant from the key, enforces the tenant's ``max_inflight`` and
``tokens_per_minute`` over all replicas together (the servers each see only
their share, so without this one tenant could take every replica), and tells the
replica who the tenant is and its class in the two headers, which it sets itself:
what the client sent in them is dropped. A client's objective may lower its
request below its tenant's class (a sheddable batch job), never raise it: the
class is the key's, not the request's. A replica honours the headers only from a
caller holding its ``--router-api-key`` (the router's ``--backend-api-key``), and
then never above the tenant's class in its own keys file.

Without a keys file the router cannot tell who sends a request: the objective
still sets its priority here (shedding), and both headers pass to the replica as
the client or gateway sent them (the replica decides whether the router's key is
trusted to name tenants).

Tokens per minute are estimated at the router, which does not always tokenize:
a prompt's characters / 4, plus ``n x max_tokens`` (16 when not given); the
router holds the whole estimate (it does not read the responses' usage), so it
is the stricter of the two gates.

Shedding (``--shed-load``): a request whose objective has a priority below zero
is shed when every replica is saturated, one with a priority of zero or more is
routed anyway (the replica's scheduler orders it); without the header, as
before, every request may be shed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..gateway.tenant_gate import TenantGate, TenantLimited
from ..gateway.tenants import DEFAULT_TENANT, Tenant, TenantDirectory
from ..gateway.priority_classes import PRIORITY_CLASSES
from .tokenize import prompt_of

OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
# Priority of a keys-file class name used as an objective: the Inference Extension's
# sense (higher first, negative sheddable), from the class's place (0 first).
_NORMAL = PRIORITY_CLASSES["normal"]
_CLASS_PRIORITY = {name: _NORMAL - value for name, value in PRIORITY_CLASSES.items()}
# The name a class goes to the replica under (the first of its names), else its number.
_CLASS_NAME = {value: name for name, value in reversed(PRIORITY_CLASSES.items())}


def parse_objectives(items: list[str]) -> dict[str, int]:
    """``NAME=PRIORITY`` items -> {name: priority}."""
    out: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = int(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(f"--objective {item!r}: expected NAME=PRIORITY (an integer, higher first)")
    return out


def objective_priority(value: str | None, table: Mapping[str, int]) -> int | None:
    """The priority an objective header names (None: no header)."""
    if value is None:
        return None
    value = value.strip()
    if value in table:
        return table[value]
    if value.lower() in _CLASS_PRIORITY:
        return _CLASS_PRIORITY[value.lower()]
    try:
        return int(value)
    except ValueError:
        return 0


@dataclass(frozen=True)
class Caller:
    """What the router knows of a request's sender, and what it tells the replica."""

    tenant: Tenant | None  # from the keys file (None: no keys file)
    fairness_id: str | None  # what goes to the replica in the fairness header (None: none)
    objective: str | None  # what goes to the replica in the objective header (None: none)
    priority: int | None  # the objective's priority here (None: no objective header)

    def headers(self) -> dict[str, str]:
        """The tenant headers for the replica (the client's own are dropped before these go in)."""
        out = {FAIRNESS_HEADER: self.fairness_id, OBJECTIVE_HEADER: self.objective}
        return {name: value for name, value in out.items() if value is not None}


def keyed_caller(tenant: Tenant, asked: int | None) -> Caller:
    """A keys-file tenant's caller: its own name, and its class, or the lower one its objective
    asks for (priority ``asked``); the priority here never above what its class gives."""
    klass = tenant.priority_class if asked is None else max(tenant.priority_class, _NORMAL - asked)
    return Caller(tenant, tenant.name, _CLASS_NAME.get(klass, str(klass)),
                  None if asked is None else _NORMAL - klass)


def estimate_tokens(path: str, body: Any) -> int:
    """The tokens a request may use, estimated without a tokenizer."""
    text, ids = prompt_of(path, body)
    prompt = len(ids) if ids is not None else len(text or "") // 4 + 1
    n = body.get("n") if isinstance(body.get("n"), int) and body.get("n", 1) > 0 else 1
    out = body.get("max_tokens") or body.get("max_completion_tokens") or body.get("max_output_tokens") or 16
    return prompt + n * (out if isinstance(out, int) and out > 0 else 16)


class RouterTenancy:
    """The router's tenant directory, objective table and tenant gate."""

    def __init__(self, keys_file: str | None, objectives: Mapping[str, int], api_key: str | None = None,
                 on_reload_failure: Callable[[], None] = lambda: None) -> None:
        self.directory = TenantDirectory(keys_file, [api_key] if api_key else []) if keys_file else None
        self.objectives = dict(objectives)
        self.gate = TenantGate()
        self.on_reload_failure = on_reload_failure

    def reload(self) -> bool:
        """Read the keys file again (SIGHUP); a bad file is logged and counted, the old one kept."""
        if self.directory is None:
            return False
        ok = self.directory.reload()
        if not ok:
            self.on_reload_failure()
        return ok

    def key_opens(self, key: str) -> bool:
        return self.directory is not None and self.directory.lookup(key) is not None

    def caller(self, headers: Mapping[str, str], key: str | None) -> Caller:
        """Who sends the request (``key``: the credential it presented) and what the replica is
        told. With a keys file the tenant comes from the key (the router's ``--api-key`` is the
        default tenant); without one, the client's headers are all there is."""
        asked = headers.get(OBJECTIVE_HEADER)
        priority = objective_priority(asked, self.objectives)
        if self.directory is None:
            return Caller(None, headers.get(FAIRNESS_HEADER), asked, priority)
        tenant = self.directory.lookup(key) if key is not None else None
        return keyed_caller(tenant or DEFAULT_TENANT, priority)

    def admit(self, caller: Caller, path: str, body: Any) -> int:
        """Count the request against its tenant's limits across replicas; returns the
        tokens held (give them back with ``done``). Raises TenantLimited."""
        if caller.tenant is None:
            return 0
        tokens = estimate_tokens(path, body)
        self.gate.admit(caller.tenant, 1, 0, tokens)
        return tokens

    def done(self, caller: Caller) -> None:
        if caller.tenant is not None:
            self.gate.finished(caller.tenant, 1, 0)


__all__ = ["Caller", "FAIRNESS_HEADER", "OBJECTIVE_HEADER", "RouterTenancy", "TenantLimited",
           "estimate_tokens", "keyed_caller", "objective_priority", "parse_objectives"]
