"""Tenants: which team a caller is, where the scheduler places its requests, and
what it may use at once.

``--api-keys-file`` (YAML or JSON; reloaded on SIGHUP, the old table kept when
the new file is bad) names the tenants and their keys. Keys are stored hashed
(the SHA-256 of the key, hex), so the file opens nothing if it leaks::

    tenants:
      chat:   {priority_class: high, weight: 4, max_inflight: 64,
               tokens_per_minute: 600000, max_queued: 32}
      batch:  {priority_class: batch, weight: 1}
    keys:
      - {sha256: 3b6f..., tenant: chat}     # printf %s "$KEY" | sha256sum
      - {sha256: 9a1c..., tenant: batch}

A key's line comes from ``printf %s "$KEY" | sha256sum`` (or
``tenants.hash_key``). Every ``--api-key`` keeps
working as the ``default`` tenant (class normal, weight 1, no limits); with
neither flag nothing is checked and everyone is ``default``.

A ``--router-api-key`` (the key ``tokenmill route --backend-api-key`` or a
gateway sends) is the one credential whose request may name the tenant it is
sent for (``x-gateway-inference-fairness-id``) and that tenant's class
(``x-gateway-inference-objective``), never a better class than the file gives
the tenant (``delegated``). The operator's ``--api-key`` and tenants' keys
cannot: their headers change nothing.

The file is bounded before it is parsed (``MAX_FILE_BYTES``, ``MAX_DEPTH``, no
YAML anchors or aliases), so a file nested or aliased past reason is refused
with a ValueError like any other bad file, never a RecursionError or an
exhausted memory: at startup a clear error, on SIGHUP the old table kept.

Limits (``TenantLimits``, each optional) are enforced by ``TenantGate``
(gateway/tenant_gate.py) with a 429 and ``Retry-After`` for that tenant only:
``max_inflight`` requests (engine requests: a prompt of a completions batch
counts as one), ``tokens_per_minute`` (prompt plus ``max_tokens`` held at
admission, the unused output given back at the end, a bucket refilled
continuously) and ``max_queued`` sequences not yet producing tokens.

``adapter_dirs: [/srv/adapters/chat]`` lets a tenant load LoRA adapters over
HTTP from inside those folders (and nowhere else); without it a tenant loads
none. Administration beyond that (every other path, unloading what others
loaded, flushing caches, everyone's usage) is the operator's: whoever holds an
``--api-key`` key (``is_operator`` below).

Metric labels come from this file only (its tenants plus ``default``), so a
caller cannot grow the label set.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from .priority_classes import parse_priority_class

log = logging.getLogger("tokenmill.server")

DEFAULT_TENANT_NAME = "default"
# The Gateway API Inference Extension's request headers (router/tenancy.py)
FAIRNESS_HEADER = b"x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = b"x-gateway-inference-objective"
OTHER_TENANT_LABEL = "other"  # metric label for a name the label set does not hold
# A keys file's own shape is three levels deep and a few bytes per key: these bounds are far
# past any real file and keep a hostile or broken one from exhausting the parser.
MAX_FILE_BYTES = 8 << 20
MAX_DEPTH = 16
_JSON_TOKENS = re.compile(r'[\[\]{}"\\]')


@dataclass(frozen=True)
class TenantLimits:
    max_inflight: int | None = None
    tokens_per_minute: int | None = None
    max_queued: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_inflight", "tokens_per_minute", "max_queued"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Tenant:
    name: str
    priority_class: int = 2  # priority_classes.PRIORITY_CLASSES["normal"]
    weight: float = 1.0
    limits: TenantLimits = field(default_factory=TenantLimits)
    # folders (absolute) this tenant may load LoRA adapters from; empty: it may load none
    adapter_dirs: tuple[str, ...] = ()
    # whether the caller holds an ``--api-key`` key (or the console's session made from one):
    # set by ``TenantDirectory.lookup`` only, never by the keys file, so no tenant entry can claim it
    operator: bool = False


DEFAULT_TENANT = Tenant(DEFAULT_TENANT_NAME)

_TENANT_KEYS = {"priority_class", "class", "weight", "max_inflight", "tokens_per_minute", "max_queued",
                "adapter_dirs"}


def _adapter_dirs(name: str, value: Any) -> tuple[str, ...]:
    """``adapter_dirs``: absolute folder paths (a relative one would depend on the server's
    working directory, which the keys file's author cannot see)."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(d, str) and d for d in value):
        raise ValueError(f"tenant {name!r}: adapter_dirs must be a list of folder paths")
    relative = [d for d in value if not os.path.isabs(d)]
    if relative:
        raise ValueError(f"tenant {name!r}: adapter_dirs must be absolute paths, got {relative[0]!r}")
    return tuple(os.path.normpath(d) for d in value)


def hash_key(key: str) -> str:
    """The hex SHA-256 a keys file stores for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_tenant(name: str, spec: dict[str, Any] | None) -> Tenant:
    spec = dict(spec or {})
    unknown = set(spec) - _TENANT_KEYS
    if unknown:
        raise ValueError(f"tenant {name!r}: unknown field(s) {', '.join(sorted(unknown))}; "
                         f"use {', '.join(sorted(_TENANT_KEYS))}")
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise ValueError(f"tenant {name!r}: weight must be a positive number, got {weight!r}")
    limits = TenantLimits(spec.get("max_inflight"), spec.get("tokens_per_minute"), spec.get("max_queued"))
    return Tenant(name, parse_priority_class(spec.get("priority_class", spec.get("class"))), float(weight), limits,
                  _adapter_dirs(name, spec.get("adapter_dirs")))


@dataclass(frozen=True)
class TenantTable:
    """One loaded keys file: tenants by name, and key digests to tenant names."""

    tenants: dict[str, Tenant]
    digests: dict[bytes, str]

    @classmethod
    def parse(cls, data: Any, source: str = "keys file") -> "TenantTable":
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping with 'tenants' and 'keys'")
        unknown = set(data) - {"tenants", "keys"}
        if unknown:
            raise ValueError(f"{source}: unknown section(s) {', '.join(sorted(unknown))}")
        raw_tenants = data.get("tenants") or {}
        if not isinstance(raw_tenants, dict):
            raise ValueError(f"{source}: 'tenants' must map names to settings")
        tenants = {str(n): parse_tenant(str(n), s) for n, s in raw_tenants.items()}
        if OTHER_TENANT_LABEL in tenants:
            raise ValueError(f"{source}: the tenant name {OTHER_TENANT_LABEL!r} is reserved")
        digests: dict[bytes, str] = {}
        for i, entry in enumerate(data.get("keys") or []):
            if not isinstance(entry, dict) or set(entry) != {"sha256", "tenant"}:
                raise ValueError(f"{source}: keys[{i}] must be {{sha256: HEX, tenant: NAME}}")
            hexdigest, name = str(entry["sha256"]).strip().lower(), str(entry["tenant"])
            if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
                raise ValueError(f"{source}: keys[{i}].sha256 must be 64 hex digits (the key's SHA-256, not "
                                 "the key)")
            if name not in tenants:
                if name != DEFAULT_TENANT_NAME:
                    raise ValueError(f"{source}: keys[{i}] names tenant {name!r}, which 'tenants' does not list")
                tenants[name] = DEFAULT_TENANT
            digests[bytes.fromhex(hexdigest)] = name
        return cls(tenants, digests)

    @classmethod
    def load(cls, path: str) -> "TenantTable":
        """The file at ``path``, parsed and checked; any fault is an OSError or a ValueError."""
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise ValueError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text: {exc}") from None
        return cls.parse(parse_bounded(text, path.endswith(".json"), path), path)


def parse_bounded(text: str, is_json: bool, source: str) -> Any:
    """JSON or YAML ``text``, its nesting checked before the parser sees it (MAX_DEPTH) and YAML's
    anchors and aliases refused (an alias repeats a node without its bytes, so the file's size
    would bound nothing). Every failure is a ValueError naming ``source``."""
    import yaml

    kind = "JSON" if is_json else "YAML"
    try:
        _check_json_depth(text) if is_json else _check_yaml_events(text)
        return json.loads(text) if is_json else yaml.load(text, Loader=_yaml_loader())
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"{source}: not valid {kind}: {exc}") from None
    except (RecursionError, MemoryError) as exc:  # the bounds above should come first; never crash past them
        raise ValueError(f"{source}: not valid {kind}: {type(exc).__name__}") from None


def _check_json_depth(text: str) -> None:
    """Refuse JSON nested deeper than MAX_DEPTH; brackets inside strings do not count."""
    depth, in_string, escaped_at = 0, False, -1
    for m in _JSON_TOKENS.finditer(text):
        ch, at = m.group(), m.start()
        if in_string:
            if at == escaped_at:
                continue
            if ch == "\\":
                escaped_at = at + 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
        elif ch in "]}":
            depth -= 1


def _yaml_loader() -> Any:
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _check_yaml_events(text: str) -> None:
    """Refuse YAML nested deeper than MAX_DEPTH, or with an anchor or alias, from the parser's
    event stream (iterative, stops at the first fault), before anything is built."""
    import yaml

    depth = 0
    for event in yaml.parse(text, Loader=_yaml_loader()):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise ValueError("anchors and aliases (&name, *name) are not allowed in a keys file")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


class TenantDirectory:
    """Who a key belongs to: the keys file's tenants, the plain ``--api-key`` keys (the
    default tenant) and the ``--router-api-key`` keys (the default tenant too, and the only
    keys whose requests may speak for another tenant: ``delegated``). ``reload`` swaps the
    table in one assignment, so a lookup on the event loop sees the old table or the new one,
    never half of each."""

    def __init__(self, path: str | None = None, default_keys: Iterable[str] = (),
                 router_keys: Iterable[str] = ()) -> None:
        self.path = path
        self._default = [hashlib.sha256(k.encode()).digest() for k in default_keys]
        self._router = [hashlib.sha256(k.encode()).digest() for k in router_keys]
        if set(self._router) & set(self._default):
            raise ValueError("a --router-api-key must differ from every --api-key: the operator's key "
                             "cannot speak for tenants")
        self.reload_failures = 0  # reloads refused (the old table kept), for /metrics
        self.table = self._checked(TenantTable.load(path), path) if path else TenantTable({}, {})

    def _checked(self, table: TenantTable, source: str) -> TenantTable:
        """``table``, unless it gives a router key to a tenant (that key would be both)."""
        if any(d in table.digests for d in self._router):
            raise ValueError(f"{source}: a --router-api-key is listed as a tenant's key; give the router "
                             "its own key")
        return table

    @property
    def enabled(self) -> bool:
        """Whether any key is required."""
        return bool(self._default or self._router or self.table.digests)

    def reload(self) -> bool:
        """Read the keys file again; a bad file is logged, counted and the old table kept."""
        if not self.path:
            return False
        try:
            table = self._checked(TenantTable.load(self.path), self.path)
        except Exception as exc:  # noqa: BLE001 - it runs in a signal handler, where anything raised ends the process
            self.reload_failures += 1
            log.error("keys file %s not reloaded, keeping the previous one: %s", self.path,
                      exc if isinstance(exc, (OSError, ValueError)) else f"{type(exc).__name__}: {exc}")
            return False
        self.table = table
        log.info("keys file %s reloaded: %d tenants, %d keys", self.path, len(table.tenants), len(table.digests))
        return True

    def lookup(self, key: str) -> Tenant | None:
        """The tenant of ``key``, or None for a key nobody holds."""
        digest = hashlib.sha256(key.encode()).digest()
        table = self.table
        name = table.digests.get(digest)
        if name is not None:
            return table.tenants.get(name, DEFAULT_TENANT)
        if any(hmac.compare_digest(digest, d) for d in self._default):
            return replace(table.tenants.get(DEFAULT_TENANT_NAME, DEFAULT_TENANT), operator=True)
        if any(hmac.compare_digest(digest, d) for d in self._router):
            return table.tenants.get(DEFAULT_TENANT_NAME, DEFAULT_TENANT)
        return None

    def is_router(self, key: str) -> bool:
        """Whether ``key`` is a ``--router-api-key`` (its requests may name their tenant)."""
        digest = hashlib.sha256(key.encode()).digest()
        return any(hmac.compare_digest(digest, d) for d in self._router)

    def delegated(self, headers: Mapping[bytes, bytes]) -> Tenant:
        """The tenant a router key's request is sent for: the keys-file tenant its
        ``x-gateway-inference-fairness-id`` names (a name the file does not hold, or none: the
        default tenant), in the class its ``x-gateway-inference-objective`` names when that is
        a class name or number no better than the tenant's own (a router may lower a class,
        never raise it: a tenant's class is the keys file's, not the request's).

        A request sent for a tenant is that tenant's in every respect, ownership included: it is
        never the operator's, so a router naming each caller's tenant reaches only that tenant's
        stored objects."""
        fairness = headers.get(FAIRNESS_HEADER)
        name = fairness.decode("latin-1").strip() if fairness is not None else DEFAULT_TENANT_NAME
        table = self.table
        tenant = table.tenants.get(name) or table.tenants.get(DEFAULT_TENANT_NAME, DEFAULT_TENANT)
        objective = headers.get(OBJECTIVE_HEADER)
        if objective is not None:
            try:
                asked = parse_priority_class(objective.decode("latin-1"))
            except ValueError:
                return tenant  # an InferenceObjective name this server does not know: the tenant's own class
            if asked > tenant.priority_class:
                tenant = replace(tenant, priority_class=asked)
        return tenant

    def tenant(self, name: str) -> Tenant:
        return self.table.tenants.get(name, DEFAULT_TENANT)

    def callers(self) -> list[Tenant]:
        """The tenants a request can come as: the keys file's, and the default tenant when a
        plain ``--api-key`` (or no key at all) admits callers as it. The server divides its
        waiting room between these (gateway/waiting_room.py)."""
        tenants = dict(self.table.tenants)
        if self._default or not self.enabled:
            tenants.setdefault(DEFAULT_TENANT_NAME, DEFAULT_TENANT)
        return list(tenants.values())

    def label(self, name: str) -> str:
        """The metric label for tenant ``name``: itself when the file (or the default) holds it."""
        return name if name == DEFAULT_TENANT_NAME or name in self.table.tenants else OTHER_TENANT_LABEL

    def names(self) -> list[str]:
        """Every label a tenant metric can carry, the default first."""
        return [DEFAULT_TENANT_NAME] + sorted(n for n in self.table.tenants if n != DEFAULT_TENANT_NAME)


TENANT_SCOPE_KEY = "tokenmill.tenant"  # where the auth middleware leaves the caller's Tenant


def tenant_of(scope: Any) -> Tenant | None:
    """The caller's tenant, as the auth middleware found it (None: no key checked)."""
    return scope.get(TENANT_SCOPE_KEY)


# ---- the operator and ownership ----------------------------------------------------
#
# The operator is whoever holds an ``--api-key`` key: the Bearer key itself, or the web
# console's session (console_auth.py), which only such a key opens. A server started with no
# key at all checks nobody, and every caller is the operator, as every caller could already do
# anything. Keys-file keys are tenants, even one naming the ``default`` tenant; an operator
# request that names a tenant in ``x-gateway-inference-fairness-id`` is that tenant's.
#
# Every stored object (a stored Response, an adapter loaded over HTTP) records an owner:
# ``owner_of(caller)``, None for the operator. ``may_access`` is the one check every route that
# reads, continues or removes such an object asks; a caller it refuses gets the 404 an unknown
# id gets, word for word, so an id of someone else's cannot be told from one never made.

def is_operator(tenant: Tenant | None) -> bool:
    """Whether the caller (``tenant_of(scope)``) is the operator: None means no key was checked
    (a server without keys, or the console's session, which only the operator's key opens)."""
    return tenant is None or tenant.operator


def owner_of(tenant: Tenant | None) -> str | None:
    """The owner recorded on what ``tenant`` makes: its name, or None for the operator."""
    return None if is_operator(tenant) else tenant.name  # type: ignore[union-attr]


def may_access(caller: Tenant | None, owner: str | None) -> bool:
    """Whether ``caller`` may read, continue or remove an object ``owner`` made: the operator
    everything, a tenant only its own (an operator's object, owner None, is no tenant's)."""
    if is_operator(caller):
        return True
    return owner is not None and caller is not None and caller.name == owner


def may_use(caller: Tenant | None, owner: str | None) -> bool:
    """Whether ``caller`` may see and use a shared resource (a LoRA adapter) ``owner`` made:
    the operator's are there for everyone to use; a tenant's are ``may_access``'s."""
    return owner is None or may_access(caller, owner)


def directory_from_args(path: str | None, api_keys: str | list[str] | None,
                        router_keys: list[str] | None = None) -> TenantDirectory:
    keys = [api_keys] if isinstance(api_keys, str) else list(api_keys or [])
    if path is not None and not os.path.exists(path):
        raise ValueError(f"--api-keys-file {path}: no such file")
    return TenantDirectory(path, keys, router_keys or [])
