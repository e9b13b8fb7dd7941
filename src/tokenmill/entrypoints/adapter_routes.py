"""LoRA adapters over HTTP: the serve flags, hot load and unload, and their model cards.

``--enable-lora --lora-modules name=path ...`` registers adapters at start (a
bad one stops the start with the reason); ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's names and bodies) add and remove them while
the server runs. Like every route they sit behind the API key (auth.py denies
by default). A request names an adapter in its ``model`` field; ``/v1/models``
lists each adapter with the base model as its ``parent``.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from ..engine.adapters import AdapterNotFound
from ..model.lora import LoraError
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


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> PlainTextResponse:
    state = _manager(request)
    if body.lora_name in state.settings.served_model_names:
        raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
    try:
        await state.adapters.load(body.lora_name, body.lora_path)
    except LoraError as exc:
        raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> PlainTextResponse:
    state = _manager(request)
    try:
        await state.adapters.unload(body.lora_name)
    except AdapterNotFound:
        raise APIError(404, f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name",
                       code="lora_not_found") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def adapter_cards(state: Any) -> list[dict[str, Any]]:
    """Model cards of the adapters: vLLM's shape (``root`` the folder, ``parent`` the base)."""
    if state.adapters is None:
        return []
    return [{"id": a.name, "root": a.path, "parent": state.model_name, "max_model_len": state.max_model_len}
            for a in state.adapters.adapters.values()]
