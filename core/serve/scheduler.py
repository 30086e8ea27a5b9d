"""Continuous batching: every active sequence advances in one forward per step.

Requests from the chat pane and from HTTP land in one queue. Each step packs the
decode token of every running sequence plus a chunk of any pending prompt into
one batch, ordered by mix so sequences that share a mix share their LoRA
matmuls. Sequences with different mixes still share all base matmuls.

Events are delivered by calling ``request.on_event`` on the scheduler thread;
consumers move them to their own thread (asyncio: call_soon_threadsafe; Qt: a
queued signal).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..lora.meter import METER_INTERVAL_S, MeteredDeltas
from ..lora.mix import MixKey, MixWeights
from ..lora.runtime import AdapterStacks, LoraDeltas
from ..model.deltas import batch_spans
from ..model.kv_cache import ContextOverflow, KVCache
from ..model.llama import BatchItem, LlamaModel
from .grammar import Constraint, ConstraintError
from .prefix_cache import PrefixCache
from .relay import step_events
from .sampling import (
    NonFiniteLogits,
    SamplingParams,
    StopMatcher,
    log_softmax,
    make_sampler,
    top_logprobs,
)

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # prompt tokens per sequence per step: bounds memory, keeps decode moving
SPEC_NGRAM = (4, 3)  # n-gram sizes tried for prompt lookup, longest first
SPEC_COOLDOWN = 4  # plain steps after a draft that paid off poorly, doubled per
SPEC_BACKOFF_MAX = 4  # further poor draft in a row, up to 4 << 4 = 64 steps
SPEC_MIN_GAIN = 3  # accepted tokens a draft must yield to keep drafting
# An idle engine admits a request only when no other arrives within ADMIT_GAP_S of the
# last one (ADMIT_WINDOW_S at most): requests sent together start in one step (#22)
ADMIT_GAP_S = 0.002
ADMIT_WINDOW_S = 0.010
CAPACITY_ROUND = 64  # prefix-cache entries are sized in steps of this many positions
SERVER_ERROR = "server_error"  # DoneEvent.error_type of a request the engine failed (HTTP 500)
NON_FINITE = (
    "the model's output for this request is not finite (NaN or infinity): its numbers "
    "overflowed float32, most likely from its LoRA mix (scale or adapter weights)"
)


@dataclass
class TokenEvent:
    token: int
    text: str  # text released by this token (may be "")
    logprob: float | None = None  # of the chosen token, when n_probs > 0
    top: list[tuple[int, float]] | None = None  # top-n (id, logprob), when n_probs > 0
    kind: str = "token"
    slot: int = -1  # the KV pool slot the request runs in (id_slot of a stream's chunks)


@dataclass
class Timings:
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cache_n: int = 0

    def as_dict(self) -> dict:
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": 1e3 * self.prompt_n / self.prompt_ms if self.prompt_ms else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / self.predicted_n
            if self.predicted_n
            else 0.0,
            "predicted_per_second": 1e3 * self.predicted_n / self.predicted_ms
            if self.predicted_ms
            else 0.0,
        }


@dataclass
class DoneEvent:
    stop_type: str  # "eos" | "limit" | "word" | "cancel" | "error"
    content: str
    tokens: list[int]
    timings: Timings
    mix: MixKey
    stopping_word: str = ""
    error: str | None = None
    error_type: str = ""  # e.g. "exceed_context_size_error"
    id_slot: int = -1  # the KV pool slot the request ran in
    truncated: bool = False  # the context filled up (and was shifted, or ended it)
    kind: str = "done"


@dataclass
class SlotTask:
    """The last request a KV pool slot ran (what /slots shows of an idle slot and
    the mix a slot save records: its keys/values were computed under that mix)."""

    id_task: int
    mix: MixKey
    n_prompt: int
    processed: int
    cached: int
    n_decoded: int


@dataclass
class PromptProgressEvent:
    """One prompt chunk evaluated (sent only to requests with ``progress`` set): at most
    one per prefill chunk (PREFILL_CHUNK, or -b/-ub's physical batch), the last one with
    done == total."""

    done: int  # prompt tokens in the cache so far, cached prefix included
    total: int  # prompt tokens
    cache_n: int  # of which came from the prefix cache
    time_ms: float  # spent evaluating this prompt so far
    start: bool = False  # the report at admission, before any chunk (llama-server's first)
    kind: str = "progress"


@dataclass
class MeterEvent:
    """The channel meters of one decode step of this request (core/lora/meter.py),
    sent at most every METER_INTERVAL_S to requests with ``meter_parts``."""

    values: dict[int, float]  # adapter id -> its delta's size relative to the base
    vectors: dict[int, float] = field(default_factory=dict)  # vector id -> its meter
    kind: str = "meter"


Event = TokenEvent | DoneEvent | PromptProgressEvent | MeterEvent


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    mix: MixKey  # snapshotted at admission by the engine
    mix_weights: MixWeights | None
    on_event: Callable[[Event], None]
    cache_prompt: bool = True
    source: str = ""
    id: int = field(default_factory=itertools.count().__next__)
    cancelled: threading.Event = field(default_factory=threading.Event)
    admitted_step: int = -1  # the scheduler step that first ran it
    progress: bool = False  # also send a PromptProgressEvent per prompt chunk
    id_slot: int = -1  # the KV pool slot asked for (llama-server's id_slot), -1: any
    # each adapter of the mix as a one-adapter mix: set, the request's steps are
    # metered (MeterEvent); None, never
    meter_parts: dict[int, MixWeights] | None = None
    # with meter_parts, each control vector of the mix as what it alone adds after
    # each block, (n_layers, d)
    meter_vectors: dict[int, np.ndarray] = field(default_factory=dict)
    # an aLoRA's request (core/lora/alora.py): its first base_until prompt positions run
    # without the aLoRA, under base_mix (the mix's control vectors alone, or () the base
    # model), so their KV is base_mix's and is shared as such
    base_until: int = 0
    base_mix: MixKey = ()
    base_weights: MixWeights | None = None

    def cancel(self) -> None:
        self.cancelled.set()


def prompt_lookup(history: list[int], k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last
    n-gram of ``history`` (n = 4, then 3), or [] when there is none."""
    h = np.asarray(history, dtype=np.int64)
    for n in SPEC_NGRAM:
        if len(h) <= n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)  # (len-n, n)
        hits = np.flatnonzero((windows == h[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return [int(t) for t in h[start : start + k]]
    return []


class _Seq:
    """One running request: its cache, sampler and the text it has released."""

    def __init__(
        self,
        req: Request,
        cache: KVCache,
        n_cached: int,
        tokenizer,
        eog,
        chunk: int = PREFILL_CHUNK,
    ):
        self.chunk = chunk  # prompt tokens per step
        self.req = req
        self.cache = cache
        self.pending = list(req.prompt[n_cached:])  # prompt tokens not yet run
        self.history = list(req.prompt)  # for penalties
        self.generated: list[int] = []
        # a grammar-constrained request gets its own parser state; others pay nothing
        constraint = Constraint(req.params.grammar, tokenizer) if req.params.grammar else None
        self.sampler = make_sampler(req.params, eog, constraint)
        self.decoder = tokenizer.decoder()
        self.stops = StopMatcher(req.params.stop)
        self.timings = Timings(cache_n=n_cached)
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        self.content: list[str] = []
        self.next_token: int | None = None  # sampled, not yet run through the model
        self.draft: list[int] = []  # speculative tokens after next_token
        self.spec_cooldown = 0  # steps to wait after a rejected draft
        self.spec_misses = 0  # poor drafts in a row
        self.recompute = 0  # pending tokens re-evaluated by a context shift (not prompt)
        self.truncated = False  # the context filled up
        self.metered_at = 0.0  # perf_counter of its last metered step

    @property
    def done_prompt(self) -> int:
        """Prompt positions in the cache so far."""
        return len(self.req.prompt) - len(self.pending)

    @property
    def on_base(self) -> bool:
        """This step runs base positions of an aLoRA request (under its base_mix)."""
        return bool(self.pending) and self.done_prompt < self.req.base_until

    def inputs(self) -> np.ndarray:
        if self.pending:
            n = self.chunk
            if self.on_base:  # a chunk never straddles the aLoRA's switch
                n = min(n, self.req.base_until - self.done_prompt)
            return np.asarray(self.pending[:n], dtype=np.int64)
        return np.asarray([self.next_token] + self.draft, dtype=np.int64)

    @property
    def deterministic(self) -> bool:
        return self.req.params.temperature <= 0


class Scheduler:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer,
        prefix_cache: PrefixCache,
        ctx_size: int,
        n_parallel: int,
        draft_max: int = 0,
        context_shift: bool = False,
        prefill_chunk: int = PREFILL_CHUNK,
        stacks: AdapterStacks | None = None,
    ):
        self.model = model
        # several mixes' adapters stacked, for decode steps mixing them (the engine's)
        self.stacks = stacks if stacks is not None else AdapterStacks(model.cfg)
        # prompt tokens per sequence per step: llama-server's physical batch, min(-b, -ub)
        self.prefill_chunk = max(1, prefill_chunk)
        self.context_shift = context_shift  # --context-shift: a full context drops old tokens
        self.tokenizer = tokenizer
        self.prefix = prefix_cache
        self.ctx_size = ctx_size
        self.n_parallel = max(1, n_parallel)
        self.draft_max = draft_max  # prompt-lookup speculative tokens per step (0: off)
        self.drafted = self.accepted = 0  # speculation statistics
        self.queue: queue.Queue[Request] = queue.Queue()
        # running sequences' KV: one slot each (zero pages until used)
        self.pool = model.new_pool(self.n_parallel, ctx_size)
        self.active: list[_Seq] = []
        # per pool slot, the last request that ran in it (GET /slots, slot save)
        self.slot_last: list[SlotTask | None] = [None] * self.n_parallel
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._admit_lock = threading.Lock()  # a submit_many batch is admitted as a whole
        self.busy = False
        self.steps = 0
        self.running = False  # True while run() serves (what Engine.health reports)
        self.step_failures = 0  # steps that raised unexpectedly and were survived
        self.last_failure = ""
        # work that must run on the engine thread (it owns the model and the pool):
        # (fn, future) pairs, run between steps by _run_calls
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )

    # -- public -------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raise ContextOverflow or ValueError for a request that cannot run."""
        if len(req.prompt) >= self.ctx_size:
            raise ContextOverflow(
                f"the prompt has {len(req.prompt)} tokens, which exceeds the context size of "
                f"{self.ctx_size}"
            )
        if not req.prompt:
            raise ValueError("the prompt is empty")

    def submit(self, req: Request) -> Request:
        return self.submit_many([req])[0]

    def submit_many(self, reqs: list[Request]) -> list[Request]:
        """Queue requests so that they are admitted together (when slots allow): A/B
        compare's two sides then start in the same step. All are checked first; a
        bad one raises and none is queued."""
        for req in reqs:
            self.check(req)
        with self._admit_lock:
            for req in reqs:
                self.queue.put(req)
        self._wake.set()
        return reqs

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between two steps and return a Future of
        its result. The model (and its scratch buffers) belongs to that thread, so any
        forward pass that is not a generation (scoring a text, embeddings) goes here.
        If the loop stops before running it, the Future is cancelled."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut))
        self._wake.set()
        return fut

    def _run_calls(self) -> bool:
        ran = False
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # the caller gets the error; the loop goes on
                fut.set_exception(e)

    def slot_states(self) -> list[dict]:
        """Each pool slot's state for GET /slots: the request running in it, else the
        last one that did (read from another thread: a snapshot, not a lock)."""
        running = {s.cache.slot: s for s in list(self.active)}
        out = []
        for i, last in enumerate(list(self.slot_last)):
            s = running.get(i)
            st: dict = {"id": i, "is_processing": s is not None}
            if s is not None:
                p = s.req.params
                n_remain = p.n_predict - len(s.generated) if p.n_predict >= 0 else -1
                st.update(id_task=s.req.id, n_prompt_tokens=len(s.req.prompt),
                          n_prompt_tokens_processed=s.timings.prompt_n,
                          n_prompt_tokens_cache=s.timings.cache_n,
                          n_decoded=len(s.generated), n_remain=n_remain,
                          steer=getattr(s.req.mix, "steer", ()))  # fmt: skip
            elif last is not None:
                st.update(id_task=last.id_task, n_prompt_tokens=last.n_prompt,
                          n_prompt_tokens_processed=last.processed,
                          n_prompt_tokens_cache=last.cached, n_decoded=0, n_remain=-1,
                          steer=getattr(last.mix, "steer", ()))  # fmt: skip
            out.append(st)
        return out

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        """Serve until stop(). Call from the one engine thread.

        A step that raises (a bug, or a value no check foresaw) fails the requests it
        was running, with the error named, and the loop goes on serving: one request
        must never stop generation for everyone."""
        self.running = True
        try:
            while not self._stop.is_set():
                try:
                    with step_events():  # one hand-over per consumer loop per step (#22)
                        did = self.step()
                except Exception as e:
                    self._survive(e)
                    continue
                if not did:
                    self._wake.wait(0.05)
                    self._wake.clear()
            for s in list(self.active):
                self._finish(s, "cancel")
            self.active.clear()
        finally:
            self.running = False
            while True:  # nobody will run what is left: do not leave callers waiting
                try:
                    _, fut = self._calls.get_nowait()
                except queue.Empty:
                    break
                fut.cancel()

    def _survive(self, e: Exception) -> None:
        """After an unexpected error in a step: fail that step's sequences, keep going."""
        log.exception("scheduler step %d failed; failing its requests", self.steps)
        self.step_failures += 1
        self.last_failure = f"{type(e).__name__}: {e}"
        self._fail(list(self.active), f"internal error in the engine: {self.last_failure}")

    def step(self) -> bool:
        """Admit, run one batched forward, sample. False when there was nothing to do."""
        ran_calls = self._run_calls()
        self._admit()
        for s in [s for s in self.active if s.req.cancelled.is_set()]:
            self._finish(s, "cancel")
        if not self.active:
            self.busy = False
            return ran_calls
        self.busy = True
        # Order by mix so equal mixes are adjacent and share their LoRA matmuls.
        seqs = sorted(self.active, key=lambda s: s.req.mix)
        if self.draft_max and len(seqs) == 1:
            self._propose(seqs[0])
        items = [BatchItem(s.inputs(), s.cache, all_logits=bool(s.draft)) for s in seqs]
        t0 = time.perf_counter()
        metered = self._metered(seqs, t0)
        try:
            mixes = [s.req.base_weights if s.on_base else s.req.mix_weights for s in seqs]
            deltas = LoraDeltas.of(items, mixes, self.stacks)
            if metered is not None:
                m = seqs[metered].req
                row = batch_spans([len(it.tokens) for it in items])[metered][1] - 1
                deltas = MeteredDeltas(deltas, row, m.mix_weights, m.meter_parts, m.meter_vectors)
            logits = self.model(items, deltas)
        except Exception as e:  # a bug must not kill the engine thread: fail these requests
            log.exception("forward failed")
            self._fail(seqs, f"internal error in the forward pass: {type(e).__name__}: {e}")
            return True
        dt = (time.perf_counter() - t0) * 1e3
        self.steps += 1
        if metered is not None:
            seqs[metered].metered_at = t0
            self._emit(seqs[metered], MeterEvent(deltas.values(), deltas.vector_values()))
        for s, it, lg in zip(seqs, items, logits):
            try:
                self._advance(s, len(it.tokens), lg, dt)
            except (NonFiniteLogits, ConstraintError) as e:  # no token can be sampled
                self._fail([s], str(e))
            except Exception as e:  # a bug in one sequence's sampling: fail it alone
                log.exception("sampling failed for request %s", s.req.id)
                self._fail([s], f"internal error while sampling: {type(e).__name__}: {e}")
        return True

    @staticmethod
    def _metered(seqs: list[_Seq], now: float) -> int | None:
        """The index of the one sequence whose step this forward meters: a decoding
        request with meters, unmetered for METER_INTERVAL_S, the longest-waiting
        first (several streams take turns)."""
        due = [
            (s.metered_at, i)
            for i, s in enumerate(seqs)
            if (s.req.meter_parts or s.req.meter_vectors)
            and s.req.mix_weights is not None
            and not s.pending
            and now - s.metered_at >= METER_INTERVAL_S
        ]
        return min(due)[1] if due else None

    def _advance(self, s: _Seq, n: int, lg: np.ndarray, dt: float) -> None:
        """Book the n tokens a sequence just ran and sample from its logits lg."""
        # Every step, prompt chunks included: non-finite logits mean this step wrote
        # non-finite keys/values (the last row attends to all of them), so the
        # sequence fails now, and its slot is scrubbed, before anything reuses it.
        if not np.isfinite(lg).all():
            self._fail([s], NON_FINITE)
            return
        if s.pending:
            del s.pending[:n]
            if s.recompute:  # a context shift re-evaluating kept tokens: generation time
                s.recompute = max(0, s.recompute - n)
                s.timings.predicted_ms += dt
            else:
                s.timings.prompt_n += n
                s.timings.prompt_ms += dt
                if s.req.progress:
                    self._emit_progress(s)
            if s.pending:
                return  # more prompt to run before we can sample
            if s.req.params.n_predict == 0:
                self._finish(s, "limit")  # prompt evaluation only (llama-server semantics)
                return
        else:
            s.timings.predicted_ms += dt
            if s.draft:
                self._verify(s, lg)
                return
        self._sample(s, lg[-1])

    # -- prompt-lookup speculative decoding ---------------------------------------------
    def _propose(self, s: _Seq) -> None:
        """Draft the tokens that followed the latest earlier occurrence of the sequence's
        last n-gram. Only for deterministic (greedy) sampling, where verification can
        reproduce plain decoding exactly, and only for a lone sequence: in a batch the
        matmuls already run at batch > 1, so extra rows would cost real time."""
        if s.pending or not s.deterministic or s.req.params.grammar:
            return  # a grammar's parser state advances per sampled token: no drafts
        if s.spec_cooldown:
            s.spec_cooldown -= 1
            return
        p = s.req.params
        room = s.cache.capacity - s.cache.length - 2
        if p.n_predict >= 0:
            room = min(room, p.n_predict - len(s.generated) - 1)
        k = min(self.draft_max, room)
        if k > 0:
            s.draft = prompt_lookup(s.history, k)

    def _verify(self, s: _Seq, logits: np.ndarray) -> None:
        """Accept draft tokens while the sampler would have chosen them anyway; the first
        disagreement becomes the next token, so output equals plain greedy decoding."""
        draft, s.draft = s.draft, []
        self.drafted += len(draft)
        verified = s.cache.trim(len(draft))  # the cache holds base + [next_token] again
        for i in range(len(draft) + 1):
            # KV up to inputs[i] is valid for predicting the token after it
            if i:
                s.cache.untrim(verified[i - 1 : i])
            if not self._sample(s, logits[i]):
                return
            if i == len(draft) or s.next_token != draft[i]:
                # A step with 9 rows costs 2-3 plain steps here (blocked products vs
                # gemv, core/model/linear.py), so after a draft that paid off poorly, decode
                # plainly for a while, and for longer after each further poor draft:
                # text that rarely repeats its context (chat) then almost never pays
                # for drafts, while text that does (copying, code) keeps drafting.
                if i < SPEC_MIN_GAIN:
                    s.spec_cooldown = SPEC_COOLDOWN << min(s.spec_misses, SPEC_BACKOFF_MAX)
                    s.spec_misses += 1
                else:
                    s.spec_cooldown = s.spec_misses = 0
                self.accepted += i
                return

    # -- internals ------------------------------------------------------------
    def _admit(self) -> None:
        if not self.active and not self.queue.empty():
            self._gather_arrivals()
        with self._admit_lock:
            self._admit_queued()

    def _gather_arrivals(self) -> None:
        """The engine was idle and a request just came: wait while more keep arriving
        (each within ADMIT_GAP_S of the last, ADMIT_WINDOW_S at most), so that requests
        sent together start in the same step and prefill as one batch. Over HTTP, 8
        clients' requests reach the queue a few ms apart (each handler parses, encodes
        and submits in turn); without this the first ran its prefill alone and the
        others joined one or more steps later (#22). A lone request waits ADMIT_GAP_S."""
        deadline = time.perf_counter() + ADMIT_WINDOW_S
        n = self.queue.qsize()
        while n < self.n_parallel and not self._stop.is_set():
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._wake.clear()
            self._wake.wait(min(ADMIT_GAP_S, left))
            m = self.queue.qsize()
            if m == n:
                return  # none arrived within the gap: start now
            n = m

    def _admit_queued(self) -> None:
        while len(self.active) < self.n_parallel:
            try:
                req = self.queue.get_nowait()
            except queue.Empty:
                return
            if req.cancelled.is_set():
                self._emit_done(req, DoneEvent("cancel", "", [], Timings(), req.mix))
                continue
            try:
                self._start(req)
            except Exception as e:  # this request alone fails; the others are admitted
                log.exception("admitting request %s failed", req.id)
                msg = f"internal error while starting the request: {type(e).__name__}: {e}"
                self._emit_done(req, _error_done(req, msg))

    def _start(self, req: Request) -> None:
        """Give a request a KV slot (with its cached prefix, if any) and make it active."""
        cache, n_cached = None, 0
        try:
            if req.cache_prompt:
                if req.base_until:  # an aLoRA's base positions are its base_mix's
                    entry, n_cached = self.prefix.take(
                        req.base_mix, req.prompt, limit=req.base_until
                    )
                else:
                    entry, n_cached = self.prefix.take(req.mix, req.prompt)
                if entry is not None:
                    # the slot it was copied from may still hold it: then no copy back
                    # (unless the request asked for another slot by id_slot)
                    slot, gen = entry.origin
                    if req.id_slot < 0 or req.id_slot == slot:
                        cache = self.pool.reclaim(slot, gen, entry.tokens[:n_cached])
                    if cache is None:
                        cache = self.pool.acquire(req.id_slot)
                        cache.copy_prefix_from(entry, n_cached)
            if cache is None:
                cache = self.pool.acquire(req.id_slot)
            req.admitted_step = self.steps
            seq = _Seq(
                req, cache, n_cached, self.tokenizer, self.tokenizer.eog_ids, self.prefill_chunk
            )
            self.active.append(seq)
            if req.progress:  # llama-server's first report: nothing evaluated yet
                self._emit_progress(seq, start=True)
        except BaseException:
            if cache is not None and self.pool.holds(cache):
                self.pool.release(cache, scrub=True)
            raise

    def _sample(self, s: _Seq, logits: np.ndarray) -> bool:
        """Choose and emit the next token; False when the sequence finished."""
        p = s.req.params
        tok = s.sampler(logits, s.history)
        now = time.perf_counter()
        if s.t_first is None:
            s.t_first = now
        ev = TokenEvent(tok, "", slot=s.cache.slot)
        if p.n_probs > 0:
            top = top_logprobs(logits, p.n_probs)
            lp = dict(top).get(tok)
            if lp is None:
                lp = float(log_softmax(logits)[tok])
            ev.logprob, ev.top = lp, top
        s.generated.append(tok)
        s.history.append(tok)
        s.timings.predicted_n += 1

        # a finished grammar allows only an end-of-generation token: it ends the
        # sequence even under ignore_eos (which never bans it for a grammar)
        if self.tokenizer.is_eog(tok) and (not p.ignore_eos or p.grammar):
            ev.text = s.stops.feed(s.decoder.flush())
            s.content.append(ev.text)
            self._emit(s, ev)
            self._finish(s, "eos")
            return False
        ev.text = s.stops.feed(s.decoder.push(tok))
        s.content.append(ev.text)
        self._emit(s, ev)
        if s.stops.hit is not None:
            self._finish(s, "word", stopping_word=s.stops.hit)
        elif p.n_predict >= 0 and len(s.generated) >= p.n_predict:
            self._finish(s, "limit")
        elif s.cache.length + 1 >= s.cache.capacity:
            s.truncated = True
            if self.context_shift and self._shift(s, tok):
                return True
            self._finish(s, "limit")
        else:
            s.next_token = tok
            return True
        return False

    def _shift(self, s: _Seq, tok: int) -> bool:
        """llama-server's context shift: keep the first n_keep tokens, drop n_discard of
        the others (default half), and go on generating; False when nothing can be
        dropped. The remaining tokens' keys are recomputed from the token ids (they
        move to new positions) rather than re-rotated in place as llama.cpp does: one
        re-evaluation of at most half the context per shift, exact for every RoPE
        variant (llama3 factors, LongRoPE) and for sliding-window layers."""
        p, toks = s.req.params, s.cache.tokens
        n_keep = len(s.req.prompt) if p.n_keep < 0 else p.n_keep
        if self.tokenizer.add_bos and self.tokenizer.bos_id is not None:
            n_keep += 1  # llama-server's n_keep does not count the BOS
        n_keep = max(0, min(s.cache.capacity - 4, n_keep))
        n_left = len(toks) - n_keep
        n_discard = max(0, min(p.n_discard or n_left // 2, n_left - 1))
        if n_discard < 1:
            return False
        s.pending = toks[:n_keep] + toks[n_keep + n_discard :] + [tok]
        s.recompute = len(s.pending)
        s.cache.trim(s.cache.length)
        s.next_token = None
        return True

    def _emit_progress(self, s: _Seq, start: bool = False) -> None:
        t = s.timings
        total = len(s.req.prompt)
        done = total - len(s.pending)
        self._emit(s, PromptProgressEvent(done, total, t.cache_n, t.prompt_ms, start=start))

    def _emit(self, s: _Seq, ev: Event) -> None:
        try:
            s.req.on_event(ev)
        except Exception:  # a consumer's bug must not stop other sequences
            log.exception("event consumer failed; cancelling request %s", s.req.id)
            s.req.cancel()

    def _fail(self, seqs: list[_Seq], error: str) -> None:
        """Finish these sequences with an error (HTTP 500, "server_error"). Never raises:
        whatever happens, each request gets its DoneEvent and its slot back."""
        for s in seqs:
            try:
                self._finish(s, "error", error=error)
            except Exception:
                log.exception("finishing failed request %s failed too", s.req.id)
                if s in self.active:
                    self.active.remove(s)
                try:
                    if self.pool.holds(s.cache):
                        self.pool.release(s.cache, scrub=True)
                except Exception:
                    log.exception("could not return the slot of request %s", s.req.id)
                self._emit_done(s.req, _error_done(s.req, error, s))

    def _finish(self, s: _Seq, stop_type: str, stopping_word: str = "", error: str | None = None):
        if s in self.active:
            self.active.remove(s)
        tail = s.stops.feed(s.decoder.flush()) if stop_type not in ("eos", "error") else ""
        tail += s.stops.flush() if s.stops.hit is None else ""
        if tail:
            s.content.append(tail)
            self._emit(s, TokenEvent(-1, tail, kind="text", slot=s.cache.slot))
        if s.req.cache_prompt and stop_type != "error" and s.cache.length:
            # the slot goes back to the pool; the prefix cache keeps a compact copy
            capacity = -(-s.cache.length // CAPACITY_ROUND) * CAPACITY_ROUND
            snap = self.pool.snapshot(s.cache, capacity)
            if s.req.base_until:  # an aLoRA's: only its base positions, kept as base_mix's
                snap.trim(snap.length - min(snap.length, s.req.base_until))
                if snap.length:
                    self.prefix.put(s.req.base_mix, snap)
            else:
                self.prefix.put(s.req.mix, snap)
        if self.pool.holds(s.cache):
            t = s.timings
            self.slot_last[s.cache.slot] = SlotTask(
                s.req.id, s.req.mix, len(s.req.prompt), t.prompt_n, t.cache_n, len(s.generated)
            )
            # a failed sequence's keys/values may be NaN/inf: none may linger in the pool
            self.pool.release(s.cache, scrub=stop_type == "error")
        done = DoneEvent(
            stop_type,
            "".join(s.content),
            list(s.generated),
            s.timings,
            s.req.mix,
            stopping_word=stopping_word,
            error=error,
            error_type=SERVER_ERROR if stop_type == "error" else "",
            id_slot=s.cache.slot,
            truncated=s.truncated,
        )
        self._emit_done(s.req, done)

    def _emit_done(self, req: Request, ev: DoneEvent) -> None:
        try:
            req.on_event(ev)
        except Exception:
            log.exception("event consumer failed on done")


def _error_done(req: Request, error: str, s: _Seq | None = None) -> DoneEvent:
    """The DoneEvent of a request that failed, with what it had produced so far."""
    return DoneEvent(
        "error",
        "".join(s.content) if s else "",
        list(s.generated) if s else [],
        s.timings if s else Timings(),
        req.mix,
        error=error,
        error_type=SERVER_ERROR,
    )
