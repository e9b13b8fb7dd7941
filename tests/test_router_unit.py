"""Unit tests of the router's pieces: block index, policies, parsing. No servers."""
from __future__ import annotations

import asyncio
import json

import pytest

from tokenmill.router.backend import Backend, BackendStats, endpoint_of, normalize_url
from tokenmill.router.config import RouterConfig
from tokenmill.router.policy import LeastLoad, PrefixAware, RoundRobin
from tokenmill.router.pool import parse_backend_metrics
from tokenmill.router.cache.prefix_index import PrefixIndex, block_hashes
from tokenmill.router.tokenize import CharChunker, LocalTokenizer, chat_to_text, prompt_of


def test_block_hashes_are_chained_and_drop_partial_tail():
    a = block_hashes(list(range(40)), 16)
    b = block_hashes(list(range(32)) + [99] * 8, 16)
    assert len(a) == 2 and a == b  # the partial third block never counts
    c = block_hashes([7] + list(range(1, 40)), 16)
    # Changing the first block changes every later key: keys encode the whole prefix.
    assert c[0] != a[0] and c[1] != a[1]
    # Same block content at a different position hashes differently.
    d = block_hashes(list(range(16, 32)) + list(range(16, 32)), 16)
    assert d[0] != d[1]


def test_prefix_index_match_and_lru_evicts_leaves_first():
    idx = PrefixIndex(capacity_blocks=6)
    p1 = block_hashes(list(range(64)), 16)  # 4 blocks
    idx.insert(p1)
    assert idx.match(p1) == 4
    assert idx.match(block_hashes(list(range(32)) + [5] * 32, 16)) == 2
    p2 = block_hashes([1000 + i for i in range(64)], 16)
    idx.insert(p2)  # 8 blocks > 6: p1's two leaves go first, its root stays
    assert len(idx) == 6
    assert idx.match(p2) == 4
    assert idx.match(p1) == 2
    idx.resize(3)
    assert len(idx) == 3 and idx.match(p2) == 3
    idx.clear()
    assert idx.match(p2) == 0


def test_prefix_index_keeps_longest_prefix_of_oversized_chain():
    idx = PrefixIndex(capacity_blocks=3)
    keys = block_hashes(list(range(16 * 5)), 16)
    idx.insert(keys)
    assert idx.match(keys) == 3


def _backend(url: str, in_flight: int = 0, blocks: list[bytes] | None = None) -> Backend:
    b = Backend(url=url, index=PrefixIndex(1000), healthy=True, in_flight=in_flight)
    if blocks:
        b.index.insert(blocks)
    return b


def test_prefix_policy_prefers_overlap_then_spreads_on_imbalance():
    cfg = RouterConfig(backends=["x"], imbalance_abs=2, imbalance_rel=1.5, kv_usage_weight=0)
    keys = block_hashes(list(range(160)), 16)
    a = _backend("http://a:1", blocks=keys[:8])
    b = _backend("http://b:1", blocks=keys[:3])
    c = _backend("http://c:1")
    pol = PrefixAware(cfg)
    d = pol.choose([a, b, c], keys)
    assert d.backend is a and d.reason == "prefix_hit" and d.matched_blocks == 8
    a.in_flight = 3  # 3 - 0 > 2 and 3 > 0: overloaded
    d = pol.choose([a, b, c], keys)
    assert d.backend is b and d.reason == "imbalance"  # next best overlap, not the idle cold one
    a.in_flight, b.in_flight, c.in_flight = 4, 3, 2  # 4 - 2 = 2: not overloaded
    assert pol.choose([a, b, c], keys).backend is a


def test_prefix_policy_miss_goes_to_least_loaded_then_emptiest():
    cfg = RouterConfig(backends=["x"], kv_usage_weight=0)
    other = block_hashes([9] * 64, 16)
    a = _backend("http://a:1", in_flight=1)
    b = _backend("http://b:1", blocks=other)
    c = _backend("http://c:1")
    d = PrefixAware(cfg).choose([a, b, c], block_hashes(list(range(64)), 16))
    assert d.backend is c and d.reason == "prefix_miss"


def test_short_shared_system_prompt_does_not_herd():
    cfg = RouterConfig(backends=["x"], kv_usage_weight=0, min_match_ratio=0.1)
    system = list(range(16))  # one block everybody shares
    keys = block_hashes(system + [500 + i for i in range(16 * 19)], 16)  # 20 blocks, 1 shared
    a = _backend("http://a:1", in_flight=1, blocks=block_hashes(system + [7] * 32, 16))
    b = _backend("http://b:1")
    d = PrefixAware(cfg).choose([a, b], keys)
    assert d.backend is b and d.reason == "prefix_miss"
    # Two shared blocks of twenty reach the 10% bar: the overlap wins again.
    keys2 = block_hashes(system + [7] * 16 + [900 + i for i in range(16 * 18)], 16)
    assert PrefixAware(cfg).choose([a, b], keys2).backend is a


def test_load_counts_external_requests_but_not_ours_twice():
    b = _backend("http://a:1", in_flight=2)
    b.stats = BackendStats(running=3, waiting=2, inflight_at_scrape=2, kv_usage=0.5)
    assert b.external_load() == 3
    assert b.load(0) == 5 and b.load(2.0) == 6


def test_round_robin_and_least_load():
    cfg = RouterConfig(backends=["x"], kv_usage_weight=0)
    bs = [_backend(f"http://{n}:1") for n in "abc"]
    rr = RoundRobin(cfg)
    assert [rr.choose(bs, []).backend.url for _ in range(6)] == [b.url for b in bs] * 2
    bs[0].in_flight, bs[1].in_flight, bs[2].in_flight = 2, 0, 1
    assert LeastLoad(cfg).choose(bs, []).backend is bs[1]


def test_parse_backend_metrics_vllm_names():
    text = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="m"} 3',
        'vllm:num_requests_waiting{model_name="m"} 2',
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25',
        "# TYPE vllm:prefix_cache_queries counter",
        'vllm:prefix_cache_queries_total{model_name="m"} 1000',
        "# TYPE vllm:prefix_cache_hits counter",
        'vllm:prefix_cache_hits_total{model_name="m"} 640',
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="2048"} 1',
        "",
    ])
    s = parse_backend_metrics(text)
    assert (s.running, s.waiting, s.kv_usage) == (3, 2, 0.25)
    assert (s.prefix_queries, s.prefix_hits) == (1000, 640)
    assert (s.num_gpu_blocks, s.block_size) == (2048, 32)


def test_prompt_extraction_for_completions_and_chat():
    assert prompt_of("/v1/completions", {"prompt": "hi"}) == ("hi", None)
    assert prompt_of("/v1/completions", {"prompt": ["a", "b"]}) == ("a", None)
    assert prompt_of("/v1/completions", {"prompt": [1, 2, 3]}) == (None, [1, 2, 3])
    assert prompt_of("/v1/completions", {"prompt": [[4, 5], [6]]}) == (None, [4, 5])
    text, ids = prompt_of("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image_url", "image_url": {}}]},
    ]})
    assert ids is None and text == "<|system|>\nbe brief\n<|user|>\nhello\n"
    # A conversation that grows keeps its earlier text as a prefix.
    longer = chat_to_text([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                           {"role": "assistant", "content": "hi"}])
    assert longer.startswith(text)
    assert prompt_of("/v1/completions", "junk") == (None, None)


def test_char_chunker_and_local_tokenizer(tmp_path):
    toks = asyncio.run(CharChunker(8).encode("abcdefghij"))
    assert toks.mode == "chars" and toks.block_size == 8 and len(block_hashes(toks.ids, toks.block_size)) == 1
    # A small word-level tokenizer.json built with the tokenizers library itself.
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tk.save(str(path))
    local = LocalTokenizer(str(tmp_path), block_size=2)
    out = asyncio.run(local.encode("hello world hello zzz"))
    assert out.ids == [1, 2, 1, 0] and out.mode == "local"


def test_urls_and_endpoints():
    assert normalize_url("127.0.0.1:8001/") == "http://127.0.0.1:8001"
    assert endpoint_of("http://10.1.2.3:8000") == "10.1.2.3:8000"
    assert endpoint_of("http://[fd00::1]:8000") == "[fd00::1]:8000"
    assert endpoint_of("http://example") == "example:80"


def test_config_validation():
    with pytest.raises(ValueError):
        RouterConfig(backends=["http://a:1"], policy="random").validate()
    with pytest.raises(ValueError):
        RouterConfig().validate()


def test_cli_registers_route_subcommand():
    import argparse

    from tokenmill.router.cli import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["route", "--backend", "http://127.0.0.1:8001", "--backend", "127.0.0.1:8002",
                              "--policy", "round-robin", "--endpoint-picker", "--grpc-port", "9100"])
    cfg = config_from_args(args)
    assert cfg.backends == ["http://127.0.0.1:8001", "127.0.0.1:8002"]
    assert cfg.policy == "round-robin" and cfg.endpoint_picker and cfg.grpc_port == 9100
    assert callable(args.func)


def test_router_package_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, tokenmill.router.cli, tokenmill.router.server, tokenmill.router.k8s.ext_proc, "
            "tokenmill.router.workload; print(json.dumps(['torch' in sys.modules, "
            "any(m.startswith('tokenmill.engine') for m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [False, False]


def test_remote_tokenizer_uses_backend_then_falls_back_to_chars():
    import httpx

    from tokenmill.router.tokenize import RemoteTokenizer

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        if request.url.host == "good":
            return httpx.Response(200, json={"tokens": [5, 6, 7], "count": 3})
        return httpx.Response(404, json={"detail": "Not Found"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            tok = RemoteTokenizer(client, block_size=16, fallback=CharChunker(64))
            good = await tok.encode("abc", "m", "http://good:1")
            bad = await tok.encode("abc", "m", "http://bad:1")
            again = await tok.encode("abc", "m", "http://good:1")  # stays on chars once unsupported
            return tok, good, bad, again

    tok, good, bad, again = asyncio.run(go())
    assert good.ids == [5, 6, 7] and good.mode == "remote" and good.block_size == 16
    assert calls[0] == {"prompt": "abc", "model": "m"}
    assert bad.mode == "chars" and bad.ids == [97, 98, 99] and bad.block_size == 64
    assert tok.unsupported and again.mode == "chars" and len(calls) == 2


def test_scraped_cache_size_sets_index_capacity_and_restart_clears_it():
    import httpx

    from tokenmill.router.pool import BackendPool

    cfg = RouterConfig(backends=["http://a:1"], block_size=16)
    pool = BackendPool(cfg, httpx.AsyncClient())
    b = pool.get("http://a:1")
    b.index.insert(block_hashes(list(range(64)), 16))
    pool._apply_stats(b, BackendStats(num_gpu_blocks=100, block_size=32, prefix_queries=50))
    assert b.index.capacity_blocks == 200 and len(b.index) == 4  # 100 blocks of 32 = 200 of ours
    pool._apply_stats(b, BackendStats(num_gpu_blocks=100, block_size=32, prefix_queries=10))
    assert len(b.index) == 0  # counters went backwards: the server restarted with a cold cache


def test_health_check_timeouts_need_two_in_a_row_but_refusals_count_at_once():
    import httpx

    from tokenmill.router.pool import BackendPool

    mode = {"a": "timeout"}

    def handler(request: httpx.Request) -> httpx.Response:
        if mode["a"] == "timeout":
            raise httpx.ReadTimeout("slow", request=request)
        if mode["a"] == "refused":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, text="" if request.url.path == "/metrics" else "{}")

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            pool = BackendPool(RouterConfig(backends=["http://a:1"]), client)
            b = pool.get("http://a:1")
            b.healthy = True
            await pool.check(b)
            first = b.healthy  # one timeout: still in rotation
            await pool.check(b)
            second = b.healthy  # two in a row: out
            mode["a"] = "ok"
            await pool.check(b)
            back = b.healthy
            mode["a"] = "refused"
            await pool.check(b)
            return first, second, back, b.healthy

    assert asyncio.run(go()) == (True, False, True, False)
