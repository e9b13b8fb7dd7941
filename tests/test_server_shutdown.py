"""Shutdown edges with a real `tokenmill serve`: when the grace period runs out, running
streams end with an OpenAI-shaped error event and [DONE], the log has one line per cut
request and no traceback, and a client that sent half a body does not hold shutdown."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from test_server_support import health_probe, real_server

pytestmark = pytest.mark.slow


def test_grace_expiry_ends_streams_in_band_and_half_bodies_do_not_hold_shutdown():
    with real_server("--shutdown-grace", "1", "--kv-cache-memory", "128MiB", "--request-read-timeout", "120",
                     "--max-num-seqs", "4") as server:
        started = threading.Barrier(4)
        streams: list[list[str]] = [[] for _ in range(3)]

        def stream(i: int) -> None:
            body = {"prompt": f"Story number {i}:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
            with httpx.Client(timeout=120) as client, client.stream(
                    "POST", server.url + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        streams[i].append(line[6:])
                        if len(streams[i]) == 1:
                            started.wait(60)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        half = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=30)
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5000\r\n\r\n{\"prompt\": \"never finished")
        started.wait(120)
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        reply = half.recv(65536)
        half_answered = time.monotonic() - sent
        half.close()
        for t in threads:
            t.join(60)
        assert server.proc.wait(30) == 0
        exited = time.monotonic() - sent
    assert reply.startswith(b"HTTP/1.1 503"), reply[:100]
    assert half_answered < 2
    assert exited < 15
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert err["code"] == "shutting_down" and err["type"] == "service_unavailable", err
        assert len(events) > 3  # tokens arrived before the cut
    log = "\n".join(server.lines)
    assert "Traceback" not in log, log[-3000:]
    assert sum("cut at shutdown" in line for line in server.lines) == 3, log[-3000:]


def test_default_capture_holds_nothing_the_client_sent_and_survives_sigkill(tmp_path):
    from tokenmill.traffic.capture import read_capture

    capture = tmp_path / "cap.jsonl"
    sent: list[str] = []
    with real_server("--capture-traffic", str(capture), "--kv-cache-memory", "128MiB") as server:
        with httpx.Client(timeout=120) as client:
            for i in range(3):
                prompt, stop = f"Quartz owl number {i} sings", f"violet{i}"
                sent += [prompt, stop]
                r = client.post(server.url + "/v1/completions",
                                json={"prompt": prompt, "max_tokens": 4, "stop": [stop], "stream": i == 1})
                assert r.status_code == 200
            system, user, stop = "You answer in riddles.", "Where does the marmalade river flow?", "zzstop"
            sent += [system, user, stop]
            r = client.post(server.url + "/v1/chat/completions", json={
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                "max_tokens": 4, "stop": stop})
            assert r.status_code == 200
        server.proc.kill()  # SIGKILL: no shutdown code runs
        server.proc.wait(30)
    text = capture.read_text()
    problems: list[tuple[str, int, str]] = []
    recs = read_capture([capture], problems)
    assert len(recs) == 4 and not problems
    assert all(r["key_id"] for r in recs) and (tmp_path / ".cap.jsonl.key").exists()
    for s in sent:
        for piece in [s, *s.split()]:
            if len(piece) > 3:
                assert piece not in text, piece


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmRSS:"))


def test_a_50mb_body_does_not_stall_health_and_its_memory_comes_back():
    """With the limit raised above 50 MB the body is read, parsed and refused (too long for the
    context, before tokenizing); /health keeps answering and RSS returns near where it was."""
    with real_server("--kv-cache-memory", "128MiB", "--max-request-bytes", str(64 << 20)) as server:
        with httpx.Client(timeout=60) as client:  # warm-up: the first requests allocate for good
            for _ in range(2):
                assert client.post(server.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hello " * 200}], "max_tokens": 2}).status_code == 200
        time.sleep(1)
        before = _rss_mb(server.proc.pid)
        with health_probe(server.url, interval_s=0.02, timeout=30) as latencies:
            body = json.dumps({"messages": [{"role": "user", "content": "lorem ipsum dolor " * 2_900_000}],
                               "max_tokens": 4}).encode()
            assert len(body) > 50_000_000
            resp = httpx.post(server.url + "/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"}, timeout=120)
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
            too_big = httpx.post(server.url + "/v1/completions", content=b"x" * (65 << 20),
                                 headers={"content-type": "application/json"}, timeout=120)
            assert too_big.status_code == 413
            del body
            time.sleep(1.5)
        after = _rss_mb(server.proc.pid)
    latencies.sort()
    print(f"/health: {len(latencies)} probes, p99 {latencies[int(0.99 * (len(latencies) - 1))]:.3f} s, "
          f"max {latencies[-1]:.3f} s; RSS {before:.0f} MB before, {after:.0f} MB after")
    assert len(latencies) >= 10 and latencies[int(0.99 * (len(latencies) - 1))] < 1.0, latencies[-5:]
    assert after - before < 100, (before, after)
