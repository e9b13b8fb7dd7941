"""The disk tier with real servers on loopback: a second server on a folder one already holds is
refused, naming the holder, while the first serves the same greedy tokens as a server without
the tier; a tier bigger than its filesystem is refused at start with both numbers; a filesystem
that fills up while serving turns the tier off (log line, metrics) and the server goes on,
answering as before. The full-disk cases use a small tmpfs (mounting needs root; skipped
otherwise). Slow: real servers with the bundled model."""
from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from fake_backend import free_port
from test_server_support import metric, real_server, serve_command

pytestmark = pytest.mark.slow

# float32 and a 32-block pool: six documents of about ten blocks each push each other out
FLAGS = ("--dtype", "float32", "--quantization", "none", "--num-blocks", "32", "--max-model-len", "512",
         "--max-num-seqs", "2", "--threads", "1", "--no-ui")
ENV = {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
WORDS = ["amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper"]
DOCS = [f"Document {d}. " + " ".join(f"Entry {d}.{i} reads {WORDS[(3 * d + i) % len(WORDS)]}." for i in range(24))
        for d in range(6)]


def _answers(url: str) -> list[str]:
    """Each document twice, all of them in between: the second round finds its blocks evicted."""
    out = []
    with httpx.Client(timeout=300) as client:
        for doc in DOCS + DOCS:
            r = client.post(url + "/v1/completions",
                            json={"prompt": doc + " Summary:", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
    return out


@pytest.fixture(scope="module")
def reference() -> list[str]:
    with real_server(*FLAGS, env=ENV) as server:
        return _answers(server.url)


def _refused(*extra: str, timeout: float = 240.0) -> str:
    """Start `tokenmill serve` expecting it to exit non-zero before it serves; its stderr."""
    port = free_port()
    proc = subprocess.Popen(serve_command("--port", str(port), *FLAGS, *extra), env=dict(os.environ, **ENV),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    pytest.fail("the server started where it should have been refused")
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the server neither started nor exited")
            time.sleep(0.25)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        reader.join(10)
    err = b"".join(lines).decode(errors="replace")
    assert proc.returncode == 2, err
    assert "Traceback" not in err, err
    return err


def test_a_second_server_on_one_tier_folder_is_refused_and_the_first_serves_the_same_tokens(tmp_path, reference):
    folder = str(tmp_path / "tier")
    tier = ("--kv-offload-bytes", "64MiB", "--kv-offload-dir", folder)
    with real_server(*FLAGS, *tier, env=ENV) as first:
        err = _refused(*tier)
        assert f"is in use by another tokenmill process (pid {first.proc.pid} on host " in err, err
        assert _answers(first.url) == reference
        text = httpx.get(first.url + "/metrics", timeout=30).text
        assert metric(text, "tokenmill:kv_tier_restored_blocks_total") > 0
        assert metric(text, "tokenmill:kv_tier_rejected_blocks_total") == 0


@pytest.fixture
def small_fs(tmp_path) -> Path:
    """A 16 MiB tmpfs under ``tmp_path`` (unmounted afterwards)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_tier_bigger_than_its_filesystem_is_refused_at_start(small_fs):
    err = _refused("--kv-offload-bytes", "64MiB", "--kv-offload-dir", str(small_fs / "tier"))
    assert "--kv-offload-bytes asks for 67108864 bytes (64.0 MiB)" in err, err
    assert "MiB) free" in err, err


def _fill(folder: Path) -> None:
    """Write a file until the filesystem has no byte left."""
    with open(folder / "filler", "wb", buffering=0) as fh:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    fh.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC


def test_a_disk_filling_up_turns_the_tier_off_and_the_server_goes_on(small_fs, reference):
    with real_server(*FLAGS, "--kv-offload-bytes", "8MiB", "--kv-offload-dir", str(small_fs / "tier"),
                     env=ENV) as server:
        _fill(small_fs)
        assert _answers(server.url) == reference
        assert server.proc.poll() is None
        text = httpx.get(server.url + "/metrics", timeout=30).text
        assert metric(text, "tokenmill:kv_tier_disabled") == 1
        assert metric(text, "tokenmill:kv_tier_errors_total") >= 1
        assert any("KV disk tier" in line and "turned off after an error" in line for line in server.lines)
        assert _answers(server.url) == reference  # and again, without the tier
