"""LoRA adapters over HTTP: the serve flags, hot load and unload, and their model cards.

``--enable-lora --lora-modules name=path ...`` registers adapters at start (a
bad one stops the start with the reason); ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's names and bodies) add and remove them while
the server runs. Like every route they sit behind the API key (auth.py denies
by default). A request names an adapter in its ``model`` field; ``/v1/models``
lists each adapter with the base model as its ``parent``.

Who may do what: the operator (tenants.is_operator) loads from any path and
unloads any adapter. A tenant whose keys-file entry lists ``adapter_dirs``
loads only from inside those folders (adapter_paths.py) and unloads only what
it loaded; other tenants get 403. An adapter a tenant loaded is its own: other
tenants neither see it in ``/v1/models`` nor use nor unload it (404, as for a
name never loaded); the operator's adapters are everyone's to use.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from ...engine.adapters import AdapterNotFound
from ...model.lora.lora import LoraError
from ...gateway.tenants import Tenant, is_operator, may_access, may_use, owner_of, tenant_of
from .adapter_paths import allowed_adapter_path
from .errors import APIError

router = APIRouter()


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_int_id: int | None = None


def _manager(request: Request) -> Any:
    state = request.app.state.tokenmill
    if state.adapters is None:
        raise APIError(400, "LoRA adapters are not enabled on this server (start it with --enable-lora)",
                       code="lora_disabled")
    return state


def _administrator(request: Request) -> Tenant | None:
    """The caller, when it may administer adapters at all: the operator, or a tenant whose
    keys-file entry lists ``adapter_dirs``; anyone else gets 403."""
    caller = tenant_of(request.scope)
    if not is_operator(caller) and not caller.adapter_dirs:  # type: ignore[union-attr]
        raise APIError(403, "loading and unloading LoRA adapters needs the operator's API key, or a tenant "
                       "whose keys-file entry lists adapter_dirs", code="operator_only")
    return caller


# One message for every path a tenant may not load from: outside its adapter_dirs, escaping them
# by a symlink or "..", missing, or not an adapter at all. It names no path and says nothing about
# which of those it was, so the route cannot be used to explore the server's files.
NOT_LOADABLE = ("lora_path: no LoRA adapter this key may load is at that path (a tenant loads only from "
                "inside the adapter_dirs of its keys-file entry)")


def _source(caller: Tenant | None, given: str) -> str:
    """The path the adapter is read from: the operator's as given; a tenant's resolved inside
    its ``adapter_dirs`` (adapter_paths.py), else the one 400 ``NOT_LOADABLE``."""
    if is_operator(caller):
        return given
    real = allowed_adapter_path(given, caller.adapter_dirs)  # type: ignore[union-attr]
    if real is None:
        raise APIError(400, NOT_LOADABLE, param="lora_path", code="invalid_lora_adapter")
    return real


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> PlainTextResponse:
    state = _manager(request)
    caller = _administrator(request)
    if body.lora_name in state.settings.served_model_names or body.lora_name in state.adapters:
        # names are one namespace: this says a name is taken, never whose it is or where it came from
        raise APIError(400, f"lora_name {body.lora_name!r} is already in use on this server; choose another "
                       "name", param="lora_name", code="lora_name_taken")
    path = _source(caller, body.lora_path)
    try:
        await state.adapters.load(body.lora_name, path, owner=owner_of(caller))
    except LoraError as exc:
        raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> PlainTextResponse:
    """Remove an adapter: the operator any, a tenant only one it loaded (anyone else's, the
    operator's included, answers the 404 of a name never loaded)."""
    state = _manager(request)
    caller = _administrator(request)
    adapter = state.adapters.adapters.get(body.lora_name)
    try:
        if adapter is None or not may_access(caller, adapter.owner):
            raise AdapterNotFound(body.lora_name)
        await state.adapters.unload(body.lora_name)
    except AdapterNotFound:
        raise APIError(404, f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name",
                       code="lora_not_found") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def visible_adapters(state: Any, caller: Tenant | None) -> list[Any]:
    """The adapters ``caller`` may see and use (tenants.may_use): the operator's and its own."""
    if state.adapters is None:
        return []
    return [a for a in state.adapters.adapters.values() if may_use(caller, a.owner)]


def adapter_cards(state: Any, caller: Tenant | None) -> list[dict[str, Any]]:
    """Model cards of the adapters ``caller`` may use: vLLM's shape, ``parent`` the base model's
    name; ``root`` is the adapter's name too, not the folder it was read from (a server path)."""
    return [{"id": a.name, "root": a.name, "parent": state.model_name, "max_model_len": state.max_model_len}
            for a in visible_adapters(state, caller)]
