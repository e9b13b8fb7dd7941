"""Routing by model name: which replicas serve a request's ``model``, and LoRA affinity.

Each health check reads a replica's ``/v1/models`` (base models and LoRA
adapters, an adapter's card naming its ``parent``) and, from its ``/metrics``,
vLLM's ``vllm:lora_requests_info`` gauge (adapters with running and waiting
requests) plus ``tokenmill:lora_resident_info`` (every adapter resident). A
request goes to the replicas that serve its model; among them, to those with
the adapter resident (no load from disk, its weights warm) unless those are
overloaded against the least loaded replica that serves it, in which case a
replica that loads it on demand takes it. A model no replica lists goes to all
of them (a replica may have loaded it since the last check; it answers 404 if not).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .backend import Backend

LORA_INFO = "vllm:lora_requests_info"
LORA_RESIDENT = "tokenmill:lora_resident_info"


@dataclass
class ModelView:
    """What a replica serves, as last seen."""

    models: set[str] | None = None  # ids /v1/models lists; None: not read (serves anything)
    adapters: set[str] = field(default_factory=set)  # the LoRA adapters among them
    resident: set[str] = field(default_factory=set)  # adapters loaded now (or with requests)


def parse_models(body: Any) -> tuple[set[str], set[str]]:
    """(every model id, the adapters among them) of a ``/v1/models`` answer."""
    data = body.get("data") if isinstance(body, dict) else None
    ids: set[str] = set()
    adapters: set[str] = set()
    for card in data if isinstance(data, list) else []:
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            ids.add(card["id"])
            if card.get("parent"):
                adapters.add(card["id"])
    return ids, adapters


def resident_from_metrics(families: Any) -> set[str]:
    """Adapters a replica holds, from its LoRA gauges (labels are comma-separated names)."""
    names: set[str] = set()
    for family in families:
        for s in family.samples:
            if s.name == LORA_INFO:
                keys = ("running_lora_adapters", "waiting_lora_adapters")
            elif s.name == LORA_RESIDENT:
                keys = ("resident_lora_adapters",)
            else:
                continue
            for key in keys:
                names.update(n for n in s.labels.get(key, "").split(",") if n)
    return names


def view_of(backend: Backend) -> ModelView:
    view = getattr(backend, "model_view", None)
    if view is None:
        view = ModelView()
        backend.model_view = view  # type: ignore[attr-defined]
    return view


def model_of(body: Any) -> str | None:
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


def select(candidates: Sequence[Backend], model: str | None,
           overloaded: Callable[[Backend, float], bool], load: Callable[[Backend], float]) -> tuple[list[Backend], str]:
    """The replicas a request for ``model`` may go to, and why: ``model`` (those that serve
    it), ``lora_resident`` (of those, the ones with the adapter resident), or ``any``."""
    cands = list(candidates)
    if model is None:
        return cands, "any"
    serving = [b for b in cands if view_of(b).models is None or model in view_of(b).models]  # type: ignore[operator]
    if not serving:
        return cands, "any"
    if not any(model in view_of(b).adapters for b in serving):
        return serving, "model"
    warm = [b for b in serving if model in view_of(b).resident]
    if warm:
        low = min(load(b) for b in serving)
        fit = [b for b in warm if not overloaded(b, low)]
        if fit:
            return fit, "lora_resident"
    return serving, "model"
