"""TrafficCapture: record schema, block hashes, concurrency safety, rotation."""
from __future__ import annotations

import glob
import json
import threading
from pathlib import Path

from tokenmill.traffic.capture import BLOCK_SIZE, TrafficCapture, block_hashes, read_capture


def test_block_hashes_are_chained_and_skip_the_partial_block():
    a = list(range(40))
    b = list(range(20)) + [999] + list(range(21, 40))
    ca, xa = block_hashes(a)
    cb, xb = block_hashes(b)
    assert len(ca) == 40 // BLOCK_SIZE == 2
    assert ca[0] == cb[0] and ca[1] != cb[1]
    # same block content at another position: same content hash, different chain
    c = list(range(16, 32)) + list(range(16))
    cc, xc = block_hashes(c)
    assert xc[0] == xa[1] and cc[0] != ca[1]
    assert block_hashes(list(range(15))) == ([], [])
    assert block_hashes(a, key=b"k")[0] != ca  # a keyed capture hashes differently


def test_record_schema_and_text_only_when_asked(tmp_path):
    path = tmp_path / "cap.jsonl"
    with TrafficCapture(path) as cap:
        cap.record(arrival_time=1000.5, prompt_token_ids=list(range(35)), cached_tokens=16,
                   output_tokens=7, sampling={"temperature": 0.7, "max_tokens": 7, "obj": object()},
                   ttft=0.12, e2e=0.5, prompt_text="secret", endpoint="chat", request_id="r1",
                   finish_reason="length")
    with TrafficCapture(path, capture_text=True) as cap:  # appends
        cap.record(1001.0, [1, 2, 3], 0, 1, None, None, 0.01, prompt_text="visible")
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    rec = json.loads(lines[0])
    assert rec["v"] == 1 and rec["prompt_tokens"] == 35 and rec["cached_tokens"] == 16
    assert rec["output_tokens"] == 7 and rec["endpoint"] == "chat" and rec["request_id"] == "r1"
    assert rec["sampling"]["temperature"] == 0.7 and isinstance(rec["sampling"]["obj"], str)
    assert rec["ttft"] == 0.12 and rec["e2e"] == 0.5 and rec["finish_reason"] == "length"
    assert rec["block_size"] == 16 and len(rec["block_hashes"]) == 2
    assert len(rec["block_content_hashes"]) == 2
    assert "prompt_text" not in rec
    rec2 = json.loads(lines[1])
    assert rec2["prompt_text"] == "visible" and rec2["ttft"] is None
    assert [r["arrival_time"] for r in read_capture([path])] == [1000.5, 1001.0]


def test_concurrent_writers_and_rotation_lose_no_line(tmp_path):
    path = tmp_path / "cap.jsonl"
    cap = TrafficCapture(path, max_bytes=20_000, backups=50)
    n_threads, per_thread = 8, 150

    def work(t: int) -> None:
        for i in range(per_thread):
            cap.record(t * 1000 + i, list(range(t, t + 40)), 0, i, {"t": t}, 0.1, 0.2)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    cap.close()
    files = sorted(glob.glob(str(path) + "*"))
    assert len(files) > 3  # it rotated
    lines = [ln for f in files for ln in Path(f).read_text().splitlines()]
    assert len(lines) == n_threads * per_thread == cap.records_written
    recs = [json.loads(ln) for ln in lines]  # no torn lines
    assert len({(r["sampling"]["t"], r["output_tokens"]) for r in recs}) == len(recs)
    for f in files:
        assert Path(f).stat().st_size <= 20_000


def test_rotation_keeps_only_the_configured_backups(tmp_path):
    path = tmp_path / "cap.jsonl"
    with TrafficCapture(path, max_bytes=1000, backups=2) as cap:
        for i in range(100):
            cap.record(i, list(range(32)), 0, 1, {}, 0.1, 0.1)
    assert sorted(p.rsplit("/", 1)[1] for p in glob.glob(str(path) + "*")) == \
        ["cap.jsonl", "cap.jsonl.1", "cap.jsonl.2"]
    newest = read_capture([path])
    assert newest[-1]["arrival_time"] == 99.0


def test_record_after_close_or_io_error_never_raises(tmp_path):
    cap = TrafficCapture(tmp_path / "c.jsonl")
    cap.close()
    cap.record(0, [1], 0, 0, {}, None, None)  # silently ignored
    cap2 = TrafficCapture(tmp_path / "d.jsonl")
    cap2._fh.close()
    cap2._fh = open(tmp_path / "d.jsonl")  # read-only handle: writes fail
    cap2.record(0, [1], 0, 0, {}, None, None)
    assert cap2.errors == 1
    cap2.close()


def test_hashes_are_keyed_by_a_key_kept_beside_the_file(tmp_path):
    import os
    import stat

    from tokenmill.traffic.capture import key_path

    ids = list(range(48))
    first = TrafficCapture(tmp_path / "a.jsonl").make_record(0, ids, 0, 1, {}, None, None)
    keyfile = Path(key_path(tmp_path / "a.jsonl"))
    assert keyfile.name == ".a.jsonl.key" and stat.S_IMODE(os.stat(keyfile).st_mode) == 0o600
    again = TrafficCapture(tmp_path / "a.jsonl").make_record(0, ids, 0, 1, {}, None, None)
    assert again["block_hashes"] == first["block_hashes"] and again["key_id"] == first["key_id"]
    other = TrafficCapture(tmp_path / "b.jsonl").make_record(0, ids, 0, 1, {}, None, None)
    assert other["block_hashes"] != first["block_hashes"] and other["key_id"] != first["key_id"]
    unkeyed = block_hashes(ids)
    assert first["block_hashes"] != unkeyed[0] and first["block_content_hashes"] != unkeyed[1]
    # replicas given one key write comparable hashes, wherever their files are
    r1 = TrafficCapture(tmp_path / "r1" / "c.jsonl", hash_key=b"shared").make_record(0, ids, 0, 1, {}, None, None)
    r2 = TrafficCapture(tmp_path / "r2" / "c.jsonl", hash_key=b"shared").make_record(0, ids, 0, 1, {}, None, None)
    assert r1["block_hashes"] == r2["block_hashes"] and r1["key_id"] == r2["key_id"]
    assert r1["block_hashes"] == block_hashes(ids, key=b"shared")[0]
    assert not (tmp_path / "r1" / ".c.jsonl.key").exists()


def test_stop_strings_are_stored_only_with_capture_text(tmp_path):
    sampling = {"temperature": 0.5, "stop": ["hunter2", "\n\nUser:"], "max_tokens": 4}
    private = TrafficCapture(tmp_path / "p.jsonl").make_record(0, [1, 2], 0, 1, sampling, None, None,
                                                               prompt_text="my secret prompt")
    assert "stop" not in private["sampling"] and private["sampling"]["num_stop"] == 2
    assert "hunter2" not in json.dumps(private) and "secret" not in json.dumps(private)
    assert private["sampling"]["temperature"] == 0.5
    shown = TrafficCapture(tmp_path / "t.jsonl", capture_text=True).make_record(
        0, [1, 2], 0, 1, sampling, None, None, prompt_text="my secret prompt")
    assert shown["sampling"]["stop"] == ["hunter2", "\n\nUser:"] and shown["prompt_text"] == "my secret prompt"


def test_a_torn_last_line_is_reported_and_the_next_record_is_not_lost(tmp_path, capsys):
    from tokenmill.entrypoints.cli.main import main

    path = tmp_path / "torn.jsonl"
    with TrafficCapture(path) as cap:
        cap.record(1.0, list(range(40)), 0, 3, {}, 0.1, 0.2)
        cap.record(2.0, list(range(40)), 16, 3, {}, 0.1, 0.2)
    with open(path, "a") as fh:  # a writer killed mid-line
        fh.write('{"v":1,"arrival_time":3.0,"prompt_to')
    with TrafficCapture(path) as cap:  # a restarted server appends
        cap.record(4.0, list(range(40)), 0, 3, {}, 0.1, 0.2)
    with open(path, "a") as fh:
        fh.write("\x00\x00garbage\n")
    problems: list[tuple[str, int, str]] = []
    recs = read_capture([path], problems)
    assert [r["arrival_time"] for r in recs] == [1.0, 2.0, 4.0]
    assert [(p, n) for p, n, _ in problems] == [(str(path), 3), (str(path), 5)]
    assert main(["trace", "analyze", str(path)]) == 0
    out = capsys.readouterr()
    assert f"{path} line 3: skipped" in out.err and f"{path} line 5: skipped" in out.err
    assert "3 requests" in out.out and "2 unreadable lines skipped" in out.out and f"{path}:3" in out.out
