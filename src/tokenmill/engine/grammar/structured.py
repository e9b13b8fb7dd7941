"""Structured outputs: a per-request grammar that masks the sampler's logits.

Why llguidance: it installs from pip with no dependencies, builds its token
trie straight from the ``tokenizers`` JSON the engine already holds, and
refuses (rather than silently drops) JSON-schema keywords it cannot enforce,
so a request it cannot honour becomes a 400 that names the keyword instead
of free text. Its masks cost a few hundredths of a millisecond per row at a
49k vocabulary (docs/structured_outputs.md has the measurement against
xgrammar and outlines-core).

The flow: ``GrammarSpec`` (what the client asked: a JSON schema, any JSON
object, a regex, a choice, a Lark/GBNF grammar) is compiled once per
distinct grammar into a template matcher; each sequence gets a cheap copy.
Before sampling, the engine fills one bitmask row per constrained sequence
(in parallel, on a worker thread while the forward pass runs); the sampler
sets disallowed logits to -inf; after sampling, each accepted token advances
its sequence's matcher. EOS is in the mask only where the grammar accepts.

With speculative decoding a constrained sequence may run proposals: they are
cut at the first token the grammar refuses (``grammar_prefix``), and its
verify rows get one mask each, at the matcher's state after the proposals
before them (``fill_step``: llguidance advances a matcher through the draft
and rolls it back). The matcher itself only ever consumes emitted tokens, so a
rejected proposal leaves nothing to undo.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

from ...settings.grammar_limits import GrammarLimits, GrammarTooLarge, check_text
from .grammar_spec import GrammarKind, GrammarSpec, ascii_classes, ascii_schema, closed_schema, first_line
from .grammar_worker import GrammarBusy, GrammarRefused, GrammarWorkers, Vetted, digest

if TYPE_CHECKING:  # torch is imported where masks are made: the compile worker process never needs it
    import torch

COMPILE_STACK_BYTES = 64 << 20  # the server's compile thread: far more than the worker's test stack
_VETTED = 65536  # digests of grammars a worker compiled, remembered


def grammar_prefix(matcher: Any, draft: Sequence[int], eos_token_ids: Sequence[int] | frozenset[int]) -> int:
    """How many leading tokens of ``draft`` the grammar accepts from ``matcher``'s state,
    stopping before any EOS (a proposal past the end of the text is of no use, and a
    matcher that consumed EOS has no further masks). Leaves the matcher as it was."""
    if not draft or matcher.is_stopped() or matcher.is_error():
        return 0
    n = int(matcher.validate_tokens(list(draft)))
    for i in range(n):
        if draft[i] in eos_token_ids:
            return i
    return n


@dataclass
class StepMasks:
    """Grammar mask rows of one step: per constrained request, its first row in
    ``rows``; a request verifying K proposals owns 1 + K consecutive rows (the mask
    before each proposal, then the one after the last)."""

    rows: torch.Tensor
    first_row: dict[int, int] = field(default_factory=dict)  # id(request) -> row

    def has(self, request: Any) -> bool:
        return id(request) in self.first_row

    def of(self, request: Any, count: int = 1) -> torch.Tensor:
        """The ``count`` rows of ``request``."""
        start = self.first_row[id(request)]
        return self.rows[start : start + count]

    def select(self, requests: Sequence[Any]) -> torch.Tensor:
        """The first row of each of ``requests``, in order."""
        import torch

        order = torch.tensor([self.first_row[id(r)] for r in requests], dtype=torch.long)
        return self.rows.index_select(0, order)


class GrammarError(ValueError):
    """A grammar the engine cannot enforce; the message names the part."""


class StructuredOutputs:
    """Compiles grammars for one tokenizer and fills batches of token masks.

    A grammar this process has not compiled before is compiled first by a
    worker process under ``limits`` (grammar_worker.py: a crash or a timeout
    there refuses the grammar, nothing else), then here, on one compile
    thread with a large stack and a lower CPU priority than the engine.
    Compiled templates are kept up to ``limits.cache_bytes`` of their measured
    size. Thread-safe for ``compile`` and ``prepare`` (the server validates
    requests on its own threads while the engine thread runs)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 num_threads: int = 2, limits: GrammarLimits | None = None) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.limits = limits or GrammarLimits()
        self._num_threads = num_threads
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._templates: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # key -> (template, bytes)
        self.cache_bytes = 0
        self._vetted: OrderedDict[bytes, int] = OrderedDict()  # digest -> measured bytes
        self._workers: GrammarWorkers | None = None
        self._compiler: _CompileThread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.words = (vocab_size + 31) // 32
        # what masks cost: time spent filling them, and the part of it the step waited for
        self.mask_rows = 0
        self.mask_seconds = 0.0
        self.mask_wait_seconds = 0.0

    def _tok(self) -> Any:
        """The llguidance tokenizer, built on first use (it takes a moment at a 49k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                backend = self._tokenizer.backend
                self._ll_tokenizer = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
                self._executor = llguidance.LLExecutor(self._num_threads)
            return self._ll_tokenizer

    @property
    def workers(self) -> GrammarWorkers:
        with self._lock:
            if self._workers is None:
                setup = {"tokenizer": self._tokenizer.backend.to_str(), "n_vocab": self.vocab_size,
                         "eos": self.eos_token_ids}
                self._workers = GrammarWorkers(setup, self.limits)
            return self._workers

    def prepare(self, spec: GrammarSpec) -> "Future[Any]":
        """Start compiling ``spec`` without waiting: a future of its template (cached
        once done). Raises GrammarError at once for a grammar over the size limits
        and GrammarBusy when the compile queue is full."""
        key = spec.key()
        with self._lock:
            entry = self._templates.get(key)
            if entry is not None:
                self._templates.move_to_end(key)
            vetted = digest(key) in self._vetted
        done: Future[Any] = Future()
        if entry is not None:
            done.set_result(entry[0])
            return done
        try:
            self._tok()
        except Exception as exc:  # noqa: BLE001 - a tokenizer llguidance cannot read
            raise GrammarError(f"structured outputs are not available with this model's tokenizer: {exc}") from None
        try:
            check_text(spec.kind, spec.value, self.limits)
        except GrammarTooLarge as exc:
            raise GrammarError(str(exc)) from None
        compiler = self._compile_thread()
        if vetted:
            return compiler.submit(lambda: self._compile_here(spec, key, None))
        value = list(spec.value) if spec.kind == "choice" else spec.value
        first = self.workers.submit(spec.kind, value, key)

        def vetted_then_here(future: "Future[Vetted]") -> None:
            try:
                result = future.result()
            except GrammarRefused as exc:
                done.set_exception(GrammarError(str(exc)))
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                done.set_exception(exc)
                return
            chained = compiler.submit(lambda: self._compile_here(spec, key, result))
            chained.add_done_callback(lambda f: _copy_outcome(f, done))

        first.add_done_callback(vetted_then_here)
        return done

    def _compile_thread(self) -> "_CompileThread":
        with self._lock:
            if self._compiler is None:
                self._compiler = _CompileThread()
            return self._compiler

    def _compile_here(self, spec: GrammarSpec, key: str, vetted: Vetted | None) -> Any:
        """Compile in this process a grammar a worker compiled already; cache the template."""
        import llguidance

        tok = self._tok()
        try:
            grammar = vetted.grammar if vetted is not None else spec.to_llguidance()
        except Exception as exc:  # noqa: BLE001 - whatever the input did to the compiler, it is the input's fault
            raise GrammarError(first_line(str(exc))) from None
        template = llguidance.LLMatcher(tok, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(first_line(template.get_error()))
        fingerprint = digest(key)
        with self._lock:
            if vetted is not None:
                self._vetted[fingerprint] = vetted.nbytes
                while len(self._vetted) > _VETTED:
                    self._vetted.popitem(last=False)
            nbytes = self._vetted.get(fingerprint, 8 * len(grammar))
            if key not in self._templates and nbytes <= self.limits.cache_bytes:
                self._templates[key] = (template, nbytes)
                self.cache_bytes += nbytes
                while self.cache_bytes > self.limits.cache_bytes:
                    _, (_, freed) = self._templates.popitem(last=False)
                    self.cache_bytes -= freed
        return template

    def compile(self, spec: GrammarSpec) -> Any:
        """A fresh matcher for ``spec``; raises GrammarError naming what cannot be enforced
        (GrammarBusy when too many grammars wait for a worker)."""
        return self.prepare(spec).result().deep_copy()

    def validate(self, spec: GrammarSpec) -> None:
        self.prepare(spec).result()

    def close(self) -> None:
        """Stops the worker processes (they also end with this process: their stdin closes),
        the compile thread and the mask thread, and lets go of the compiled templates and the
        grammar library's tokenizer and executor.

        Why all of it: a server of several models closes an engine each time it unloads one,
        and whatever a thread still holds outlives the engine. An idle compile thread kept the
        last grammar it compiled, and with it this object, its tokenizer and its cache, so
        every load and unload left one more set (and two more threads) behind. Idempotent."""
        with self._lock:
            workers, compiler, pool = self._workers, self._compiler, self._pool
            self._workers = self._compiler = self._pool = None
        if workers is not None:
            workers.close()
        if compiler is not None:
            compiler.stop()
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            self._templates.clear()
            self.cache_bytes = 0
            self._ll_tokenizer = self._executor = None

    # -- masks --------------------------------------------------------------
    def fill(self, matchers: Sequence[Any]) -> torch.Tensor:
        """Bitmask rows (int32, 32 tokens per word) for ``matchers``, in order.

        The executor is called directly rather than through ``llguidance.torch``:
        importing that module runs ``torch.compile`` on a helper, which stalled the
        engine thread (and every stream) for over a second at the first constrained step."""
        import torch

        self._tok()
        started = time.perf_counter()
        mask = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(),
                                               self.words * 4, len(matchers))
        self.mask_rows += len(matchers)
        self.mask_seconds += time.perf_counter() - started
        return mask

    def wait(self, future: "Future[Any]") -> Any:
        """The masks of ``fill_step_async``; the time spent waiting here
        is what they cost the step."""
        started = time.perf_counter()
        mask = future.result()
        self.mask_wait_seconds += time.perf_counter() - started
        return mask

    def fill_step(self, requests: Sequence[Any], drafts: Sequence[Sequence[int]] | None = None) -> StepMasks:
        """Mask rows for ``requests`` (engine Requests with a grammar): one row each, or,
        for a request with a non-empty entry in ``drafts`` (its proposals, each already
        accepted by its grammar), one row per verify position."""
        if drafts is None or not any(drafts):
            mask = self.fill([r.grammar for r in requests])
            return StepMasks(mask, {id(r): i for i, r in enumerate(requests)})
        import torch

        self._tok()
        started = time.perf_counter()
        plain: list[tuple[Any, int]] = []
        drafted: list[tuple[Any, int, list[int]]] = []  # llguidance refuses an empty draft here
        first: dict[int, int] = {}
        total = 0
        for request, draft in zip(requests, drafts):
            if draft:
                drafted.append((request.grammar, total, list(draft)))
            else:
                plain.append((request.grammar, total))
            first[id(request)] = total
            total += 1 + len(draft)
        mask = torch.full((total, self.words), -1, dtype=torch.int32)
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, mask.data_ptr(), self.words * 4, total)
        self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, mask.data_ptr(), self.words * 4, total)
        self.mask_rows += total
        self.mask_seconds += time.perf_counter() - started
        return StepMasks(mask, first)

    def fill_step_async(self, requests: Sequence[Any]) -> "Future[StepMasks]":
        """``fill_step`` on a worker thread for ``requests`` and their proposals as they
        are now (copied here: the step may change them while the worker runs)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")
        drafts = [list(r.spec_token_ids) for r in requests]
        return self._pool.submit(self.fill_step, list(requests), drafts)


def _copy_outcome(source: "Future[Any]", target: "Future[Any]") -> None:
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


class _CompileThread:
    """One thread with a large stack, at a lower CPU priority than the engine, that compiles grammars.

    Not a ThreadPoolExecutor: its threads start lazily, under whatever stack
    size is in force then; this one is made once with its own."""

    def __init__(self) -> None:
        self._jobs: "queue.Queue[tuple[Callable[[], Any], Future[Any]] | None]" = queue.Queue()
        with _STACK_LOCK:
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                self._thread = threading.Thread(target=self._run, daemon=True, name="tokenmill-grammar-compile")
                self._thread.start()
            finally:
                threading.stack_size(previous)

    def submit(self, fn: Callable[[], Any]) -> "Future[Any]":
        future: Future[Any] = Future()
        self._jobs.put((fn, future))
        return future

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread once the jobs already submitted are done."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except (OSError, AttributeError):
            pass
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            del job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    future.set_exception(exc)
            # an idle thread holds nothing: the job's closure reaches the whole StructuredOutputs
            del fn, future


_STACK_LOCK = threading.Lock()
