"""llama-server's service endpoints: /slots, /metrics, and the answers for features
that are off (501, ``not_supported_error``, with llama-server's wording, so a script
can tell "start it with --flag" from "no such route").

The handlers are registered by ``create_app`` like every other route, so the API-key,
Host and body-size middlewares guard them too.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ..errors import HttpError
from ..serve import slots
from ..serve.scheduler import DoneEvent
from .security import printable

NOT_SUPPORTED = "not_supported_error"
PROCESS_START = int(time.time())  # /metrics' Process-Start-Time-Unix header (llama-server)


def not_supported(message: str) -> HttpError:
    return HttpError(message, 501, NOT_SUPPORTED)


@dataclass
class Metrics:
    """What llama-server's /metrics counts, summed over the finished requests."""

    prompt_tokens: int = 0  # evaluated, cached tokens excluded
    prompt_cached: int = 0
    prompt_ms: float = 0.0
    predicted: int = 0
    predicted_ms: float = 0.0
    n_tokens_max: int = 0
    forwards: int = 0  # forward passes outside the scheduler's steps (embeddings)

    def record(self, done: DoneEvent) -> None:
        t = done.timings
        self.prompt_tokens += t.prompt_n
        self.prompt_cached += t.cache_n
        self.prompt_ms += t.prompt_ms
        self.predicted += t.predicted_n
        self.predicted_ms += t.predicted_ms
        self.n_tokens_max = max(self.n_tokens_max, t.cache_n + t.prompt_n + t.predicted_n)

    def record_embedding(self, n_tokens: int, n_forwards: int, ms: float) -> None:
        """An embedding request: no token sampled, but its prompt costs forward passes,
        counted as llama-server counts them, in prompt tokens and decode calls."""
        self.prompt_tokens += n_tokens
        self.prompt_ms += ms
        self.forwards += n_forwards

    def prometheus(self, stats: dict) -> str:
        """The Prometheus text: llama-server's metric names, HELP and TYPE lines."""
        rate = lambda n, ms: 1e3 * n / ms if ms > 0 else 0.0  # noqa: E731
        steps = stats.get("steps", 0)
        forwards = steps + self.forwards
        counters = [
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached "
             "tokens", self.prompt_tokens),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
             self.prompt_cached),
            ("prompt_seconds_total", "Total time spent processing prompts",
             self.prompt_ms / 1e3),
            ("tokens_predicted_total", "Number of generation tokens processed", self.predicted),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens",
             self.predicted_ms / 1e3),
            ("n_decode_total", "Total number of forward steps of the batch", forwards),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)",
             self.n_tokens_max),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated",
             stats.get("draft_tokens", 0)),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens "
             "accepted by the target model", stats.get("draft_accepted", 0)),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding "
             "verification steps", stats.get("draft_steps", 0)),
        ]  # fmt: skip
        gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s",
             rate(self.prompt_tokens, self.prompt_ms)),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
             rate(self.predicted, self.predicted_ms)),
            ("requests_processing", "Number of requests processing", stats.get("active", 0)),
            ("requests_deferred", "Number of requests deferred", stats.get("queued", 0)),
            ("n_busy_slots_per_decode", "Average number of busy slots per forward step",
             stats.get("busy_slot_steps", 0) / max(steps, 1)),
        ]  # fmt: skip
        lines = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, help_text, value in items:
                lines += [
                    f"# HELP llamacpp:{name} {help_text}",
                    f"# TYPE llamacpp:{name} {kind}",
                    f"llamacpp:{name} {float(value):g}",
                ]
        return "\n".join(lines) + "\n"


def slots_list(eng) -> list[dict]:
    """GET /slots: one entry per KV pool slot with llama-server's fields ("params" left
    out: llama-server drops them to keep /slots cheap). A request runs in the slot its
    ``id_slot`` names when that one is free, else in any free slot."""
    sched = eng.scheduler
    states = sched.slot_states() if sched is not None else []
    out = []
    for st in states:
        entry = {
            "id": st["id"],
            "n_ctx": eng.ctx_size,
            "speculative": eng.draft_max > 0,
            "is_processing": st["is_processing"],
        }
        if "id_task" in st:  # the slot has run a request (llama-server: task or task_prev)
            entry.update(
                id_task=st["id_task"],
                n_prompt_tokens=st["n_prompt_tokens"],
                n_prompt_tokens_processed=st["n_prompt_tokens_processed"],
                n_prompt_tokens_cache=st["n_prompt_tokens_cache"],
                next_token=[
                    {
                        "has_next_token": st["is_processing"],
                        "has_new_line": False,
                        "n_remain": st["n_remain"],
                        "n_decoded": st["n_decoded"],
                    }
                ],
                # ours: the control vectors the slot's request runs (ran) under
                control_vectors=[{"id": v, "scale": sc} for v, sc in st["steer"]],
            )
        out.append(entry)
    return out


def idle_slots(eng) -> int:
    return max(eng.n_parallel - eng.stats()["active"], 0)


async def slot_action(eng, settings, id_slot: str, action: str | None, body: dict) -> dict:
    """POST /slots/{id}?action=save|restore|erase, behind --slot-save-path as in
    llama-server (core/serve/slots.py). The pool copies run on the engine thread, the
    file I/O on a worker thread; a bad slot, filename or file is a 400. On a busy slot
    the action waits until the slot's request is done, as llama-server's does, for at
    most ``settings.slot_wait`` seconds (then 409)."""
    if settings.slot_save_path is None:
        raise not_supported(
            "This server does not support slots action. Start it with `--slot-save-path`"
        )
    try:
        sid = int(id_slot)
    except ValueError:
        raise HttpError(f"Invalid slot ID {printable(id_slot, 40)!r}") from None
    if not 0 <= sid < eng.n_parallel:
        raise HttpError(f"Invalid slot ID {sid}: the server has {eng.n_parallel} slots")
    if action not in ("save", "restore", "erase"):
        raise HttpError("Invalid action: it must be one of save, restore, erase")
    t0 = time.perf_counter()
    sched = eng.scheduler

    async def when_idle(fn):
        deadline = time.monotonic() + settings.slot_wait
        while True:
            try:
                return await _on_engine(eng, fn)
            except slots.SlotBusy:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.02)  # a client that leaves cancels this wait

    try:
        if action == "erase":
            n = await when_idle(lambda model: slots.erase(sched, sid))
            return {"id_slot": sid, "n_erased": n}
        name = body.get("filename") if isinstance(body, dict) else None
        path = slots.slot_path(settings.slot_save_path, name)
        identity = await asyncio.to_thread(slots.model_identity, eng.path, eng.config)
        if action == "save":
            img = await when_idle(lambda model: slots.take_image(sched, sid))
            mix = slots.mix_to_file(img.mix, eng.adapters())
            n_bytes = await asyncio.to_thread(slots.write_file, path, identity, mix, img)
            return {
                "id_slot": sid,
                "filename": name,
                "n_saved": len(img.tokens),
                "n_written": n_bytes,
                "timings": {"save_ms": slots.elapsed_ms(t0)},
            }
        meta, tokens, k, v, n_bytes = await asyncio.to_thread(
            slots.read_file, path, identity, eng.ctx_size
        )
        img = slots.SlotImage(tokens, k, v, slots.mix_from_file(meta.get("mix"), eng.adapters()))
        await when_idle(lambda model: slots.put_image(sched, model, sid, img))
    except slots.SlotError as e:
        raise HttpError(str(e), e.code, e.type) from None
    return {
        "id_slot": sid,
        "filename": name,
        "n_restored": len(tokens),
        "n_read": n_bytes,
        "timings": {"restore_ms": slots.elapsed_ms(t0)},
    }


async def _on_engine(eng, fn):
    return await asyncio.wrap_future(eng.run_on_engine(fn))


FIM_NEEDED = ("fim_pre", "fim_suf", "fim_mid")


def _fim_id(tokenizer, name: str) -> int | None:
    return getattr(tokenizer, "_auto_ids", {}).get(name)


def missing_fim_tokens(tokenizer) -> str:
    """'' when the vocabulary has the fill-in-the-middle tokens /infill needs, else
    which are missing (llama-server answers 501 then)."""
    missing = [n.upper() for n in FIM_NEEDED if _fim_id(tokenizer, n) is None]
    return f"the vocabulary has no {', '.join(missing)} token" if missing else ""


def _infill_extra(body) -> list[tuple[str, str]]:
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise HttpError('"input_extra" must be an array of {"filename": string, "text": string}')
    out = []
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise HttpError('extra_context chunk must contain a "text" field with a string value')
        name = chunk.get("filename", "tmp")
        if not isinstance(name, str):
            raise HttpError('extra_context chunk\'s "filename" field must be a string')
        out.append((name, chunk["text"]))
    return out


def _infill_part(tok, body, key: str) -> list[int]:
    """input_prefix / input_suffix: required; a string, or tokens mixed with strings
    (llama-server's tokenize_mixed, without special tokens)."""
    if key not in body:
        raise HttpError(f'"{key}" is required')
    v = body[key]
    bad = HttpError(f'"{key}" must be a string or a list of token ids and strings')
    if not isinstance(v, str | list):
        raise bad
    ids: list[int] = []
    for p in v if isinstance(v, list) else [v]:
        if isinstance(p, str):
            ids += tok.encode(p, add_special=False, parse_special=False)
        elif isinstance(p, int) and not isinstance(p, bool):
            ids.append(p)
        else:
            raise bad
    return ids


SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra chunks without a FIM_SEP token


def infill_prompt(eng, body, n_batch: int, n_predict: int) -> list[int]:
    """llama-server's /infill prompt (format_prompt_infill, the repo-level FIM layout):

        [FIM_REP]myproject\n [FIM_SEP]name\n text ... [FIM_SEP]filename\n
        [BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID

    The prefix keeps its last 3/4 of a batch of tokens, the suffix its first
    batch/4 - 2 - len(prompt); the extra chunks keep their last
    n_ctx - n_batch - 2 * n_predict tokens (none when that is not positive), as there."""
    tok = eng.tokenizer
    missing = missing_fim_tokens(tok)
    if missing:
        raise not_supported(f"Infill is not supported by this model: {missing}")
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise HttpError('"prompt" must be a string')
    chunks = _infill_extra(body)
    prefix = _infill_part(tok, body, "input_prefix")
    suffix = _infill_part(tok, body, "input_suffix")
    enc = lambda text: tok.encode(text, add_special=False, parse_special=False)  # noqa: E731
    prompt_ids = tok.encode(prompt, add_special=False, parse_special=True)

    extra: list[int] = []
    rep, sep = _fim_id(tok, "fim_rep"), _fim_id(tok, "fim_sep")
    if rep is not None:
        extra += [rep] + enc("myproject\n")
    for name, text in chunks:
        extra += [sep] + enc(f"{name}\n") if sep is not None else enc(SNIPPET_SEPARATOR)
        extra += enc(text)
    if sep is not None:
        extra += [sep] + enc("filename\n")

    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt_ids))))
    n_extra = min(max(0, eng.ctx_size - n_batch - 2 * n_predict), len(extra))
    head = [_fim_id(tok, "fim_pre")] + prefix[len(prefix) - n_prefix :] + prompt_ids
    if tok.add_bos and tok.bos_id is not None:
        head.insert(0, tok.bos_id)
    tail = [_fim_id(tok, "fim_suf")] + suffix[:n_suffix]
    return extra[len(extra) - n_extra :] + head + tail + [_fim_id(tok, "fim_mid")]
