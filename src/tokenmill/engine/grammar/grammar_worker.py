"""Grammar compilation in worker processes, so that no grammar can take the server down.

Why a process: the grammar library parses by recursion, and a grammar deep
enough overflows the stack with a SIGSEGV, which no ``try`` catches. So every
grammar the process has not compiled before is first compiled by a worker
process (``python -m tokenmill.engine.grammar.grammar_worker``) under limits: a
thread with a smaller stack than the server's compile thread (what passes
there passes in the server), an address-space cap (``RLIMIT_AS``), a
deadline, and a lower CPU priority than the engine. A worker that crashes
or runs past the deadline fails that one grammar (a 400) and is started
again; the server and the other requests never notice. The worker also
measures what the compiled grammar holds (glibc's heap in use before and
after), which the grammar cache is bounded by.

The queue in front of the workers is bounded (``GrammarBusy`` past it: a
429) and first come, first served; cached grammars never enter it, and
plain requests never touch it. The server shares it out before submitting
(gateway/waiting_room.py: ``CompileRoom``, per tenant and for the best class), after
the tenant's limits, so a tenant past them never takes a place in it. Grammars that crashed a worker are
remembered (by digest) and refused at once afterwards.

Protocol: 4-byte big-endian length + JSON, over the worker's stdin/stdout;
the first message carries the tokenizer.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import select
import shutil
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ...settings.grammar_limits import GrammarLimits

log = logging.getLogger("tokenmill.grammar")

WORKER_STACK_BYTES = 4 << 20  # the worker's compile thread; the server's has more (structured.py)
_STARTUP_TIMEOUT_S = 60.0
_REMEMBERED_CRASHES = 4096


@dataclass(frozen=True)
class Vetted:
    """A grammar a worker compiled: the library's grammar text, its measured size, the time it took."""

    grammar: str
    nbytes: int
    seconds: float


class GrammarRefused(ValueError):
    """The worker could not compile the grammar (malformed, over a limit, crashed); the message says which."""


class GrammarBusy(RuntimeError):
    """Too many grammars wait for a worker; the client should retry later."""


def _write(stream: BinaryIO, message: Any) -> None:
    data = json.dumps(message).encode()
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _read_exact(stream: BinaryIO, size: int) -> bytes:
    parts: list[bytes] = []
    while size:
        part = stream.read(size)
        if not part:
            raise EOFError
        parts.append(part)
        size -= len(part)
    return b"".join(parts)


def _read(stream: BinaryIO) -> Any:
    (size,) = struct.unpack(">I", _read_exact(stream, 4))
    return json.loads(_read_exact(stream, size))


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class _Worker:
    """One worker process and the pipes to it."""

    def __init__(self, setup: dict[str, Any], limits: GrammarLimits) -> None:
        self.setup = setup
        self.limits = limits
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[3])  # src/tokenmill/engine/grammar/this.py -> src
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        command = [sys.executable, "-m", "tokenmill.engine.grammar.grammar_worker"]
        nice = shutil.which("nice")
        if nice:  # niced from its first instruction: even its start-up yields to the engine
            command = [nice, "-n", "19", *command]
        self.proc = subprocess.Popen(command,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        _write(self.proc.stdin, {**self.setup, "memory_bytes": self.limits.worker_memory_bytes})
        reply = self._reply(_STARTUP_TIMEOUT_S)
        if reply is None or reply.get("ready") is not True:
            self.stop()
            raise RuntimeError(f"the grammar worker did not start: {reply}")

    def _reply(self, timeout: float) -> dict[str, Any] | None:
        """The worker's next message, or None if it died or ran past ``timeout``."""
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        try:
            return _read(self.proc.stdout)
        except (EOFError, ValueError, OSError):
            return None

    def compile(self, kind: str, value: Any) -> Vetted:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None
        started = time.monotonic()
        try:
            _write(self.proc.stdin, {"kind": kind, "value": value})
        except OSError:
            self.stop()
            raise GrammarRefused("the grammar compiler stopped while compiling it") from None
        reply = self._reply(self.limits.compile_timeout_s)
        if reply is None:
            timed_out = self.proc.poll() is None and time.monotonic() - started >= self.limits.compile_timeout_s
            code = self.stop()
            if timed_out:
                raise GrammarRefused(f"compiling it took longer than {self.limits.compile_timeout_s:g} s "
                                     "(--grammar-compile-timeout)")
            what = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            raise GrammarRefused(f"the grammar compiler crashed on it ({what}); it is too large or too deep")
        if reply.get("error") is not None:
            raise GrammarRefused(str(reply["error"]))
        return Vetted(reply["grammar"], int(reply["nbytes"]), float(reply["seconds"]))

    def stop(self) -> int | None:
        """Ends the process; returns its exit status (negative: the signal)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        return code


class GrammarWorkers:
    """A bounded queue of compilations served by ``limits.workers`` worker processes.

    ``submit`` returns a Future of ``Vetted`` (or raises GrammarBusy at once);
    the future fails with GrammarRefused when the worker refused, crashed or
    timed out. Worker processes start on first use."""

    def __init__(self, setup: dict[str, Any], limits: GrammarLimits) -> None:
        self.setup = setup
        self.limits = limits
        self._jobs: "queue.Queue[tuple[str, Any, bytes, Future[Vetted]] | None]" = queue.Queue(limits.queue_size)
        self._threads: list[threading.Thread] = []
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._crashed: "OrderedDict[bytes, str]" = OrderedDict()
        self.crashes = 0
        self.compiled = 0

    def _ensure_started(self) -> None:
        with self._lock:
            if self._threads:
                return
            for i in range(self.limits.workers):
                worker = _Worker(self.setup, self.limits)
                thread = threading.Thread(target=self._serve, args=(worker,), daemon=True,
                                          name=f"tokenmill-grammar-worker-{i}")
                self._workers.append(worker)
                self._threads.append(thread)
                thread.start()

    def submit(self, kind: str, value: Any, key: str) -> "Future[Vetted]":
        fingerprint = digest(key)
        future: Future[Vetted] = Future()
        with self._lock:
            known = self._crashed.get(fingerprint)
        if known is not None:
            future.set_exception(GrammarRefused(known))
            return future
        self._ensure_started()
        try:
            self._jobs.put_nowait((kind, value, fingerprint, future))
        except queue.Full:
            raise GrammarBusy(f"{self.limits.queue_size} grammars are already waiting to be compiled "
                              "(--grammar-queue-size); retry shortly") from None
        return future

    def _serve(self, worker: _Worker) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                worker.stop()
                return
            kind, value, fingerprint, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = worker.compile(kind, value)
            except GrammarRefused as exc:
                if worker.proc is None:  # it died or was killed: remember the grammar that did it
                    self.crashes += 1
                    log.warning("grammar worker lost: %s", exc)
                    with self._lock:
                        self._crashed[fingerprint] = str(exc)
                        while len(self._crashed) > _REMEMBERED_CRASHES:
                            self._crashed.popitem(last=False)
                future.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - a worker that cannot start: this grammar fails, not the thread
                worker.stop()
                future.set_exception(GrammarRefused(f"the grammar compiler is not available: {exc}"))
            else:
                self.compiled += 1
                future.set_result(result)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None]

    def close(self) -> None:
        for _ in self._threads:
            try:
                self._jobs.put_nowait(None)
            except queue.Full:
                pass
        for worker in self._workers:
            worker.stop()
        for thread in self._threads:
            thread.join(2)


# ---- the worker process -----------------------------------------------------------------

def _heap_in_use() -> int | None:
    """Bytes glibc's malloc has handed out (None where mallinfo2 is missing)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)


def _compile_one(tokenizer: Any, kind: str, value: Any) -> dict[str, Any]:
    import llguidance

    from .grammar_spec import GrammarSpec, first_line

    if kind == "choice":
        value = tuple(value)
    spec = GrammarSpec(kind, value)  # type: ignore[arg-type]
    before = _heap_in_use()
    started = time.perf_counter()
    try:
        grammar = spec.to_llguidance()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    except Exception as exc:  # noqa: BLE001 - whatever the input did to the compiler, it is the input's fault
        return {"error": first_line(str(exc))}
    if is_error or messages:
        return {"error": first_line(messages[0]) if messages else "the grammar is invalid"}
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        return {"error": first_line(matcher.get_error())}
    seconds = time.perf_counter() - started
    after = _heap_in_use()
    measured = (after - before) if before is not None and after is not None else 0
    del matcher
    return {"grammar": grammar, "nbytes": max(measured, 8 * len(grammar)), "seconds": seconds}


def _main() -> None:
    import resource

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the pipe
    setup = _read(stdin)
    memory = int(setup.get("memory_bytes") or 0)
    if memory > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    try:
        os.nice(19)  # the engine's steps come first on a busy machine
    except OSError:
        pass
    import llguidance

    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["n_vocab"],
                                       eos_token=setup["eos"] or None)
    _write(stdout, {"ready": True})
    threading.stack_size(WORKER_STACK_BYTES)
    while True:
        try:
            job = _read(stdin)
        except EOFError:
            return
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box.update(_compile_one(tokenizer, job["kind"], job["value"]))
            except MemoryError:
                box["error"] = "compiling it needs more memory than a grammar may use (--grammar-worker-memory)"
            except Exception as exc:  # noqa: BLE001 - reported to the server, the worker carries on
                box["error"] = f"the grammar could not be compiled: {type(exc).__name__}"

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        _write(stdout, box or {"error": "the grammar could not be compiled"})


if __name__ == "__main__":
    _main()
