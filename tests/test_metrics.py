"""/metrics reads the engine's published snapshot and nothing else: an object with only
``stats`` and ``block_size`` (no pool, scheduler or prefix cache) is enough to render it."""
from __future__ import annotations

from dataclasses import dataclass, replace

from test_server_support import metric
from tokenmill.engine.stats import EngineStats, SpecSnapshot
from tokenmill.entrypoints.server.metrics import ServerMetrics


@dataclass
class SnapshotOnly:
    stats: EngineStats
    block_size: int = 16


def test_metrics_render_from_the_snapshot_alone():
    source = SnapshotOnly(EngineStats(num_running=2, num_waiting=1, blocks_total=100, blocks_free=60,
                                      blocks_in_use=25, blocks_cached_idle=15, prefix_cache_enabled=True,
                                      prefix_cached_blocks=15, prefix_queried_tokens=300, prefix_hit_tokens=120,
                                      preemptions_total=4, prompt_tokens_computed=180))
    metrics = ServerMetrics("m", source, waiting=lambda: 3)
    text = metrics.render().decode()
    assert metric(text, "vllm:cache_config_info", num_gpu_blocks="100", block_size="16",
                  enable_prefix_caching="True") == 1
    assert metric(text, "vllm:num_requests_running") == 2
    assert metric(text, "vllm:num_requests_waiting") == 3  # the server's count, queued work included
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.25
    assert metric(text, "tokenmill:kv_cache_usage_perc") == 0.25  # every vllm: family has its alias
    assert metric(text, "vllm:prefix_cache_hits_total") == 120
    assert metric(text, "tokenmill:kv_cache_blocks", state="cached_idle") == 15
    assert metric(text, "tokenmill:prompt_tokens_computed_total") == 180
    assert "spec_decode" not in text

    # a scrape reads whatever snapshot the engine published last
    source.stats = replace(source.stats, num_running=0, preemptions_total=5,
                           spec=SpecSnapshot(4, 16, 10, (4, 3, 2, 1)))
    text = metrics.render().decode()
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "vllm:num_preemptions_total") == 5
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 3
