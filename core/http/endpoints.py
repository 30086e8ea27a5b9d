"""llama-server's service endpoints: /slots, /metrics, and the answers for features
that are off (501, ``not_supported_error``, with llama-server's wording, so a script
can tell "start it with --flag" from "no such route").

The handlers are registered by ``create_app`` like every other route, so the API-key,
Host and body-size middlewares guard them too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..serve.scheduler import DoneEvent
from . import responses as R
from .responses import HttpError
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

    def record(self, done: DoneEvent) -> None:
        t = done.timings
        self.prompt_tokens += t.prompt_n
        self.prompt_cached += t.cache_n
        self.prompt_ms += t.prompt_ms
        self.predicted += t.predicted_n
        self.predicted_ms += t.predicted_ms
        self.n_tokens_max = max(self.n_tokens_max, t.cache_n + t.prompt_n + t.predicted_n)

    def prometheus(self, stats: dict) -> str:
        """The Prometheus text: llama-server's metric names, HELP and TYPE lines."""
        rate = lambda n, ms: 1e3 * n / ms if ms > 0 else 0.0  # noqa: E731
        steps = stats.get("steps", 0)
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
            ("n_decode_total", "Total number of forward steps of the batch", steps),
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
    """GET /slots: one entry per slot, llama-server's fields (no "params": llama-server
    left them out to keep /slots cheap). Mixdesk's scheduler does not pin requests to
    numbered slots, so the first ``active`` slots show as busy."""
    stats = eng.stats()
    return [
        {
            "id": i,
            "id_task": -1,
            "n_ctx": eng.ctx_size,
            "speculative": eng.draft_max > 0,
            "is_processing": i < stats["active"],
            "next_token": {
                "has_next_token": i < stats["active"],
                "has_new_line": False,
                "n_remain": -1,
                "n_decoded": 0,
                "stopping_word": "",
            },
        }
        for i in range(eng.n_parallel)
    ]


def idle_slots(eng) -> int:
    return max(eng.n_parallel - eng.stats()["active"], 0)


def slot_action(eng, settings, id_slot: str, action: str | None) -> dict:
    """POST /slots/{id}?action=save|restore|erase, behind --slot-save-path as in
    llama-server. erase drops the cached prompts (the prefix cache is shared by all
    slots: every slot's cache goes); save/restore of a KV cache to a file is not
    supported and says so."""
    if settings.slot_save_path is None:
        raise not_supported(
            "This server does not support slots action. Start it with `--slot-save-path`"
        )
    try:
        sid = int(id_slot)
    except ValueError:
        raise HttpError(f"invalid slot id {printable(id_slot, 40)!r}") from None
    if not 0 <= sid < eng.n_parallel:
        raise HttpError(f"invalid slot id {sid}: the server has {eng.n_parallel} slots")
    if action == "erase":
        n = eng.prefix.n_entries
        eng.prefix.clear()
        return {"id_slot": sid, "n_erased": n}
    if action in ("save", "restore"):
        raise not_supported(f"slot {action} is not supported by Mixdesk (no KV cache files)")
    raise HttpError("action must be one of save, restore, erase")


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
        raise HttpError('input_extra must be a list of {"filename", "text"} objects')
    out = []
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise HttpError(f'input_extra[{i}] must be an object with a string "text"')
        name = chunk.get("filename", "")
        if not isinstance(name, str):
            raise HttpError(f"input_extra[{i}].filename must be a string")
        out.append((name, chunk["text"]))
    return out


def infill_prompt(eng, body) -> list[int]:
    """llama-server's /infill prompt: the extra files (each after FIM_SEP, when the
    vocabulary has it), then FIM_PRE prefix FIM_SUF suffix FIM_MID prompt."""
    tok = eng.tokenizer
    missing = missing_fim_tokens(tok)
    if missing:
        raise not_supported(f"Infill is not supported by this model: {missing}")
    prefix = R.get_str(body, "input_prefix", "")
    suffix = R.get_str(body, "input_suffix", "")
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise HttpError("prompt must be a string on /infill")
    enc = lambda text: tok.encode(text, add_special=False, parse_special=False)  # noqa: E731
    ids: list[int] = []
    sep = _fim_id(tok, "fim_sep")
    for name, text in _infill_extra(body):
        if sep is not None:
            ids += [sep] + enc(f"{name}\n")
        ids += enc(text)
    ids += [_fim_id(tok, "fim_pre")] + enc(prefix)
    ids += [_fim_id(tok, "fim_suf")] + enc(suffix)
    ids += [_fim_id(tok, "fim_mid")] + enc(prompt)
    if tok.add_bos and tok.bos_id is not None:
        ids.insert(0, tok.bos_id)
    return ids
