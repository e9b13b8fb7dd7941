"""`tokenmill bench --compare` with cost per successful task: runs through a router with
variants give one column per variant; an eval result scales successes by task accuracy."""
from __future__ import annotations

import argparse
import json

import pytest

from fake_openai_server import FakeConfig, FakeServer
from tokenmill.bench.cli import register
from tokenmill.bench.success import columns, parse_variant_costs
from tokenmill.router.canary.canary import CanaryConfig
from tokenmill.router.config import RouterConfig
from tokenmill.router.server import RouterServer
from tokenmill.router.canary.variants import parse_variant


def cli(*argv: str) -> int:
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    args = p.parse_args(list(argv))
    return args.func(args)


def test_variant_columns_and_cost_per_successful_task(tmp_path, capsys):
    out = tmp_path / "canary.json"
    with FakeServer(FakeConfig(ttft=0.01, itl=0.002)) as a, FakeServer(FakeConfig(ttft=0.01, itl=0.002)) as b:
        canary = CanaryConfig([parse_variant(f"base={a.url}"), parse_variant(f"int4={b.url}")], {"int4": 25})
        router = RouterServer(RouterConfig(port=0, canary=canary, health_interval=0.5)).start_in_thread()
        try:
            rc = cli("bench", "--url", router.url, "--concurrency", "2", "--num-requests", "20", "--input-len", "20",
                     "--output-len", "4", "--slo", "ttft=5", "--cost-per-hour", "3", "--output", str(out),
                     "--no-progress", "--warmup", "0")
        finally:
            router.stop()
    assert rc == 0
    data = json.loads(out.read_text())
    variants = [r["variant"] for r in data["points"][0]["records"]]
    assert sorted(set(variants)) == ["base", "int4"] and variants.count("int4") == 5
    eval_doc = tmp_path / "eval.json"
    eval_doc.write_text(json.dumps({
        "base": {"accuracy": 80.0, "safety": {"refusal_rate": 12.0, "over_refusal_rate": 0.0}},
        "candidates": [{"accuracy": 50.0, "safety": {"refusal_rate": 4.0, "over_refusal_rate": 8.0}}],
        "comparisons": [{"passed": False}]}))
    capsys.readouterr()
    assert cli("bench", "--compare", str(out), "--eval-result", str(eval_doc),
               "--variant-cost", "base=2", "--variant-cost", "int4=1") == 0
    text = capsys.readouterr().out
    assert "canary[base]" in text and "canary[int4]" in text and "$/1k successful" in text
    cols = columns([str(out)], {"base": 2.0, "int4": 1.0})
    base, int4 = cols
    assert (base.successes, int4.successes) == (15.0, 5.0)  # every request met the loose SLO
    assert base.run_cost == pytest.approx(2.0 * base.summary.duration / 3600)
    assert base.cost_per_1k_successful == pytest.approx(base.run_cost / 15 * 1000)
    row = next(line for line in text.splitlines() if line.startswith("$/1k successful"))
    assert f"{base.run_cost / (15 * 0.8) * 1000:.4f}" in row and f"{int4.run_cost / (5 * 0.5) * 1000:.4f}" in row
    assert "task accuracy" in text and "80.0%" in text
    # the eval's safety side goes with the same columns: a cheaper variant that stopped refusing shows
    row = next(line for line in text.splitlines() if line.startswith("harmful refused"))
    assert "12.0%" in row and "4.0%" in row
    row = next(line for line in text.splitlines() if line.startswith("eval gate"))
    assert "base" in row and "FAIL" in row


def test_variant_cost_parse():
    assert parse_variant_costs(["a=1.5", "b=0"]) == {"a": 1.5, "b": 0.0}
    for bad in (["a"], ["a=x"], ["=1"], ["a=-1"]):
        with pytest.raises(ValueError):
            parse_variant_costs(bad)
