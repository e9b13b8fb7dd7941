"""Routing by model: replicas that serve the request's model, LoRA affinity first."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.router.backend import Backend
from tokenmill.router.models import model_of, parse_models, resident_from_metrics, select, view_of
from tokenmill.router.cache.prefix_index import PrefixIndex


def _backend(url, models=None, adapters=(), resident=(), load=0):
    b = Backend(url, PrefixIndex(1000))
    b.healthy = True
    b.in_flight = load
    view = view_of(b)
    view.models = None if models is None else set(models) | set(adapters)
    view.adapters, view.resident = set(adapters), set(resident)
    return b


def _pick(cands, model):
    return select(cands, model, lambda b, low: b.load() - low > 4, lambda b: b.load())


def test_parse_models_and_gauges():
    ids, adapters = parse_models({"data": [{"id": "base"}, {"id": "fr", "parent": "base"}]})
    assert ids == {"base", "fr"} and adapters == {"fr"}
    text = ('vllm:lora_requests_info{running_lora_adapters="fr,de",max_lora="2",waiting_lora_adapters="es"} 1.7e9\n'
            'tokenmill:lora_resident_info{resident_lora_adapters="it"} 1\n')
    assert resident_from_metrics(text_string_to_metric_families(text)) == {"fr", "de", "es", "it"}
    assert model_of({"model": "fr"}) == "fr" and model_of({}) is None


def test_routes_to_replicas_serving_the_model_and_prefers_resident_adapters():
    a = _backend("http://a", ["base"], ["fr", "de"], resident=["fr"])
    b = _backend("http://b", ["base"], ["fr"], resident=[])
    c = _backend("http://c", ["other"])
    assert _pick([a, b, c], "fr") == ([a], "lora_resident")
    assert _pick([a, b, c], "de") == ([a], "model")  # only a serves it; loads it on demand
    assert _pick([a, b, c], "base") == ([a, b], "model")
    assert _pick([a, b, c], "nobody")[1] == "any"  # let a replica answer 404
    a.in_flight = 10  # the resident replica is overloaded: another loads the adapter
    assert _pick([a, b, c], "fr") == ([a, b], "model")
    unknown = _backend("http://d")  # model list not read yet: may serve anything
    assert _pick([unknown, c], "fr")[0] == [unknown]
