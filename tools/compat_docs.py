"""docs/compatibility.md, generated: where Mixdesk's API differs from llama-server's,
route by route, with llama.cpp's own server tests' outcomes for each route taken from
the recorded `make compat` run (docs/compat-results.json), so the page cannot drift
from the run. tests/test_compat_docs.py checks that the page on disk is what this
writes, that every test Mixdesk fails (or that the two servers disagree on) has a
reason below, and that no reason is left over from tests that no longer fail.

    python tools/compat.py --llama-server-bin PATH --record docs/compat-results.json
    python tools/compat_docs.py            # rewrites docs/compatibility.md
    python tools/compat_docs.py --check    # exit 1 if the page is not what it would write
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "compat-results.json"
PAGE = REPO / "docs" / "compatibility.md"
SERVERS = ("llama-server", "Mixdesk")

# One section per route group: its heading, the llama.cpp test files that exercise it,
# and where Mixdesk behaves differently on purpose: (what, llama-server, Mixdesk, why).
ROUTES: list[tuple[str, list[str], list[tuple[str, str, str, str]]]] = [
    (
        "`/health`, `/props`, `/models`, `/v1/models`, the web page at `/`",
        ["test_basic.py"],
        [
            ("`/props`", "llama-server's fields", "the same, plus `mixdesk_version`", "which Mixdesk answers"),
            ("`/v1/models`", "the base model only", "the base model plus one entry per adapter (`parent`, `root` as in vLLM)", "discoverability"),
            ("model id", "the `-m` path unless `--alias`", "the model file's name unless `--alias`", "a short id that clients can display"),
            ("web UI at `/` (`--no-webui`)", "llama.cpp's Svelte app, its MCP CORS proxy", "a built-in one-file chat page: streaming, Stop, Regenerate, Markdown replies rendered by the desktop's renderer (`POST /mixdesk/markdown`), max tokens, a mix per chat (sent as each request's `lora`) kept with the reply labels across a reload, a foldable phone layout, an API key checked before it is stored ([http-api.md](http-api.md#web-chat-page)); with `/sw.js`, `/manifest.webmanifest`, `/_app/version.json`; no MCP proxy", "a page to try the mix in; no build step, no third-party code"),
        ],
    ),
    (
        "`/completion`, `/completions`, `/v1/completions`",
        ["test_completion.py", "test_ignore_eos.py", "test_ctx_shift.py"],
        [
            ("requests with different mixes", "not batched together", "batched together; each gets exactly its solo output (tested against llama.cpp's reference tokens)", "base matmuls are shared, each mix adds its own low-rank term"),
            ("`lora` on a request", "overrides for that request", "the same; unlisted ids are 0; the global mix is never touched", "as documented upstream"),
            ("`\"lora\": []` on a request", "falls back to the global adapters", "every adapter off for that request", "an empty list means \"no adapters\""),
            ("prompt longer than the context", "400 `exceed_context_size_error`", "the same, with `n_prompt_tokens` and `n_ctx`", ""),
            ("`tokens_cached`", "slot's `n_past`", "prompt tokens reused from the prefix cache (`timings.cache_n`)", "matches the field's documented meaning"),
            ("`--context-shift`", "shifts the kept keys by RoPE", "drops the same tokens (`n_keep`, `n_discard`), re-evaluates what is kept", "exact for every RoPE variant and sliding window"),
            ("`return_progress`, `timings_per_token`", "progress chunks; timings on every chunk", "progress chunks, timings on progress chunks and the last one", ""),
            ("`id_slot`", "waits for that slot", "runs there when free, else in any free slot (the answer says which)", ""),
            ("`logit_bias` with a bad entry", "skipped silently", "400 for a token id outside the vocabulary or a NaN/infinite bias (-Infinity bans)", "a typo must not pass unnoticed"),
            ("samplers", "DRY, XTC, mirostat, typical-p, dynatemp, …", "penalties, top-k, top-p, min-p, temperature (llama.cpp's order)", "the rest are ignored if sent"),
        ],
    ),
    (
        "`/v1/chat/completions`, `/apply-template`",
        ["test_chat_completion.py"],
        [
            ("`\"model\": \"<adapter>\"`", "ignored (one model)", "selects that adapter at scale 1 (vLLM semantics)", "lets OpenAI clients pick a style by model name"),
            ("OpenAI responses", "`timings` extra", "`timings` and `lora` (the mix that ran) extras", ""),
            ("tools, multimodal, `/v1/responses`, `/v1/messages`", "✓", "not implemented (unknown fields are ignored)", "out of scope for a LoRA mixing desk"),
        ],
    ),
    (
        "`/lora-adapters` and run-time adapters",
        ["test_lora.py"],
        [
            ("`GET /lora-adapters`", "`id, path, scale, task_name, prompt_prefix`", "the same, plus `name`", "`name` is what `\"model\"` selects"),
            ("`--lora-init-without-apply`", "adapters read 0 in GET but stay applied at 1.0 for requests without `lora` (llama.cpp #28674)", "read 0 **and** are off", "the flag exists so nothing is applied until asked"),
            ("`POST /lora-adapters` with malformed JSON", "500", "400 `invalid_request_error`", "the client's fault, not the server's"),
            ("unknown adapter id / non-numeric scale / wrong type", "unknown ids silently ignored, non-numeric scales accepted, and the global mix reset even by an invalid POST", "400, and nothing changes", "a typo must not silently change or reset the mix"),
            ("loading and unloading adapters at run time", "no", "`POST /lora-adapters/load`, `/lora-adapters/unload`, vLLM's `/v1/load_lora_adapter`, `/v1/unload_lora_adapter` (off unless `--allow-runtime-lora`)", "the mixing desk needs it"),
            ("merge methods", "a weighted sum only", "`POST /lora-adapters` and a request's `lora` also take `{\"adapters\", \"method\", …}` ([merging.md](merging.md#over-http)); the list form is unchanged", "TIES, DARE, SVD as PEFT defines them"),
        ],
    ),
    (
        "`/embedding`, `/embeddings`, `/v1/embeddings`",
        ["test_embedding.py"],
        [
            ("embedding input longer than the physical batch", "500 \"input (N tokens) is too large to process…\"", "the same message as a 400", "the client's fault"),
            ("embeddings under a mix", "–", "computed under the request's `lora` or the global mix", "a mix changes the hidden states"),
        ],
    ),
    ("`/infill`", ["test_infill.py"], []),
    ("`/tokenize`, `/detokenize`", ["test_tokenize.py"], []),
    (
        "`/slots`",
        ["test_slot_save.py"],
        [
            ("`POST /slots/{id}?action=save\\|restore\\|erase` (`--slot-save-path`)", "llama.cpp state files", "Mixdesk's own file (model identity + mix + f32 K/V); another model's, a corrupt file or a path outside the folder is a 400; on a busy slot the action waits for its request to finish, as llama-server's (409 after 10 minutes)", "KV layout differs; never restore a cache into the wrong model"),
        ],
    ),
    ("`/metrics`", ["test_metrics.py"], []),
    (
        "Resumable streams: `X-Conversation-Id`, `/v1/stream`, `/v1/streams/lookup`",
        ["test_stream.py"],
        [
            ("kept streams", "resumable streams", "the same routes and rules; at most 64 streams kept (256 MiB at most)", "a reload must not lose a generation; invented ids must not pile up buffers"),
        ],
    ),
    (
        "Every route: API keys, CORS, `Host`, limits",
        ["test_security.py"],
        [
            ("CORS", "reflects any `Origin` by default", "no CORS headers unless `--cors-origins` (`localhost` = any loopback origin, as upstream); requests from unlisted origins refused (403), their preflights get no CORS headers", "local servers are attacked through browsers"),
            ("`Host` header", "not checked", "403 unless localhost / loopback / `--host`", "DNS rebinding"),
            ("bodies > 8 MiB", "accepted", "413", "memory safety"),
            ("`--api-key` check", "plain comparison", "`hmac.compare_digest` on every configured key", "no timing side channel"),
        ],
    ),
]  # fmt: skip

# Why a test fails on Mixdesk, or passes on one server and not the other: patterns
# ("file::test name", fnmatch) -> reason. Every such test needs one; a pattern that no
# longer matches such a test is stale and fails tests/test_compat_docs.py.
STORY = (
    "the test expects the token counts of llama.cpp's tiny story model; SmolLM2's "
    "template and vocabulary give other counts (llama-server fails it too on SmolLM2)"
)
BOS = "the story model's tokenizer adds a `<s>` BOS; SmolLM2's adds none"
REASONS: list[tuple[str, str]] = [
    ("test_chat_completion.py::test_chat_completion[[]*", STORY),
    ("test_chat_completion.py::test_chat_completion_cached_tokens*", STORY),
    ("test_chat_completion.py::test_return_progress[[]64-4-False[]]", STORY + " (64-token batches: SmolLM2's prompt needs 2, not 4)"),
    ("test_chat_completion.py::test_chat_template*", BOS),
    ("test_tokenize.py::test_tokenize_with_bos*", BOS),
    ("test_completion.py::test_completion[[]*", STORY),
    ("test_completion.py::test_completion_stream[[]*", STORY),
    ("test_completion.py::test_completion_prompt_cache*", STORY),
    ("test_completion.py::test_completion_response_fields*", STORY),
    ("test_completion.py::test_nocache_long_input_prompt*", "the prompt overflows a 256-token slot in the story model's tokens, not in SmolLM2's"),
    ("test_ctx_shift.py::*", "written for the story model's tokens: the prompts overflow (or stop at EOS) differently with SmolLM2"),
    ("test_embedding.py::test_embedding_usage_*", "bert-bge-small adds [CLS] and [SEP]; SmolLM2 adds no special tokens, so the counts are 2 per input lower"),
    ("test_embedding.py::test_embedding_mixed_input[[]-False[]]", "an empty string input: bert-bge-small's [CLS]/[SEP] make it 2 tokens; SmolLM2 gives none, and an empty input is a 400"),
    ("test_embedding.py::test_embedding_pooling_none*", "bert-bge-small's [CLS]/[SEP] token counts"),
    ("test_slot_save.py::test_slot_save_restore*", STORY),
    ("test_slot_save.py::test_slot_restore_legacy_token_list*", STORY),
    ("test_slot_save.py::test_slot_erase*", STORY),
    ("*test_local_media_file*", "multimodal input (tinygemma3's vision projector, `--mmproj`): not implemented; Mixdesk refuses the flag by name"),
    ("test_slot_save.py::*image*", "multimodal input (tinygemma3's vision projector, `--mmproj`): not implemented; Mixdesk refuses the flag by name"),
    ("test_slot_save.py::*multimodal*", "multimodal input (`--mmproj`): not implemented; Mixdesk refuses the flag by name"),
    ("test_slot_save.py::*mmproj*", "multimodal input (`--mmproj`): not implemented"),
    ("test_stream.py::test_stream_*during_model_load*", "router mode (watching a model load through the router's /models): not implemented"),
    ("test_security.py::test_cors_options*", "deliberate: llama-server reflects any Origin by default; Mixdesk sends CORS headers only to origins in --cors-origins"),
    ("test_security.py::test_cors_origins_defaults_to_localhost_with_tools_enabled*", "needs --tools (server tools), which Mixdesk does not have, and then the CORS default above"),
    ("test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers*", "deliberate: --ui-mcp-proxy, a route that fetches any URL for the browser, is not offered"),
]  # fmt: skip


def load(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def notable(servers: dict[str, dict[str, str]]) -> list[str]:
    """The tests that need a reason: Mixdesk fails them, or the servers disagree."""
    ours = servers.get("Mixdesk", {})
    theirs = servers.get("llama-server")
    keys = set(ours) | set(theirs or {})
    out = []
    for k in sorted(keys):
        mine = ours.get(k, "not run")
        other = theirs.get(k, "not run") if theirs is not None else None
        if mine == "failed" or (other is not None and "passed" in (mine, other) and mine != other):
            out.append(k)
    return out


def reason_for(test: str) -> str | None:
    for pattern, why in REASONS:
        if fnmatch.fnmatchcase(test, pattern):
            return why
    return None


def problems(data: dict) -> list[str]:
    """What keeps the page from being honest: a notable test without a reason, a reason
    whose pattern matches no notable test, a test file no route section claims."""
    servers = data["servers"]
    tests = notable(servers)
    out = [f"no reason for {t}" for t in tests if reason_for(t) is None]
    claimed = {f for _, files, _ in ROUTES for f in files}
    files = {k.split("::", 1)[0] for s in servers.values() for k in s}
    # a reason is stale when its file was run and none of that file's notable tests match
    # it; a file the record does not cover keeps its reasons for the next full run
    out += [
        f"stale reason {p!r}: no test it matches fails or differs"
        for p, _ in REASONS
        if any(fnmatch.fnmatchcase(f, p.split("::", 1)[0]) for f in files)
        and not any(fnmatch.fnmatchcase(t, p) for t in tests)
    ]
    out += [f"no route section claims {f}" for f in sorted(files - claimed)]
    return out


def _counts(results: dict[str, str], files: list[str]) -> tuple[int, int, int]:
    got = [v for k, v in results.items() if k.split("::", 1)[0] in files]
    return got.count("passed"), got.count("failed"), got.count("skipped")


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if "\\|" not in text else text


def render(data: dict) -> str:
    servers = {n: data["servers"][n] for n in SERVERS if n in data["servers"]}
    both = len(servers) == 2
    lines = [
        "# Compatibility with llama-server",
        "",
        "<!-- Generated by tools/compat_docs.py from docs/compat-results.json: edit those, "
        "not this page. -->",
        "",
        "This page is for people moving scripts or clients from llama-server to Mixdesk, or",
        "checking that Mixdesk still behaves like it: route by route, where Mixdesk differs on",
        "purpose, and how llama.cpp's own server tests for that route fare against both",
        "servers. Flags are covered in [http-api.md](http-api.md#server-flags); what the",
        "server refuses and why, in [security.md](security.md).",
        "",
        "## The test run",
        "",
        f"`make compat` runs llama.cpp's server tests from the pinned `{data.get('pin', '?')}`",
        "sdist against `main.py --headless` through one adapter of ours (`tools/compat.py`):",
        "every model preset becomes SmolLM2 (Qwen2.5-Coder-0.5B for infill), the LoRA",
        "download becomes our reference adapter, and only the tests' regexes on the story",
        "models' generated text are relaxed. With `--vs-llama-server` (or",
        "`--llama-server-bin PATH`, or `MIXDESK_LLAMA_SERVER_BIN`) it runs the same tests",
        "against llama-server built from the same sdist, on the same model, presets and",
        "adapter. Everything it builds and extracts lives in the user cache dir",
        "(`~/.cache/mixdesk/compat` on Linux), never in the repository. It is not part of",
        "`make test`.",
        "",
        "This page was generated from the run recorded in",
        "[compat-results.json](compat-results.json):",
        "",
    ]
    for name, cmds in sorted(data.get("commands", {}).items()):
        if name in servers:
            for cmd in [cmds] if isinstance(cmds, str) else cmds:
                if len(cmd) > 240:  # a re-run of single tests names each one
                    cmd = cmd[:200].rsplit(" ", 1)[0] + " …"
                    lines.append(f"- {name}: `{cmd}` (in full in the record)")
                else:
                    lines.append(f"- {name}: `{cmd}`")
    if data.get("note"):
        lines += ["", data["note"]]
    lines += [
        "",
        "To record a new run and regenerate this page:",
        "",
        "```sh",
        'make compat COMPAT_ARGS="--llama-server-bin /path/to/llama-server --record docs/compat-results.json"',
        ".venv/bin/python tools/compat_docs.py",
        "```",
        "",
    ]
    head = " | ".join(f"{n} {k}" for n in servers for k in ("passed", "failed", "skipped"))
    lines += ["| route | " + head + " |", "|---|" + "---:|" * (3 * len(servers))]
    totals = [0] * (3 * len(servers))
    for title, files, _ in ROUTES:
        cells = [c for n in servers for c in _counts(servers[n], files)]
        totals = [a + b for a, b in zip(totals, cells)]
        lines.append(f"| {title} | " + " | ".join(map(str, cells)) + " |")
    lines.append("| **total** | " + " | ".join(f"**{t}**" for t in totals) + " |")
    lines.append("")
    if both:
        passed = {n: sum(v == "passed" for v in servers[n].values()) for n in servers}
        lines += [
            f"Mixdesk passes {passed['Mixdesk']} of these tests where llama-server passes "
            f"{passed['llama-server']}, on the same model and adapter.",
            "",
        ]
    for title, files, rows in ROUTES:
        lines += [f"## {title}", ""]
        if rows:
            lines += ["| what | llama-server | Mixdesk | why |", "| --- | --- | --- | --- |"]
            lines += [f"| {' | '.join(_cell(c) for c in row)} |" for row in rows]
        else:
            lines.append("No deliberate difference.")
        lines.append("")
        counts = "; ".join(
            f"{n} passed {p}, failed {f}, skipped {s}"
            for n in servers
            for p, f, s in [_counts(servers[n], files)]
        )
        ran = any(k.split("::", 1)[0] in files for r in servers.values() for k in r)
        where = ", ".join(f"`{f}`" for f in files)
        if ran:
            lines += [f"llama.cpp's tests ({where}): {counts}.", ""]
        else:
            lines += [f"llama.cpp's tests ({where}): not in the recorded run.", ""]
        route_tests = [t for t in notable(servers) if t.split("::", 1)[0] in files]
        for t in route_tests:
            outcome = ", ".join(f"{n} {servers[n].get(t, 'not run')}" for n in servers)
            lines.append(f"- `{t}` ({outcome}): {reason_for(t) or 'NO REASON RECORDED'}")
        if route_tests:
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=PAGE)
    ap.add_argument("--check", action="store_true", help="only compare with the page on disk")
    a = ap.parse_args(argv)
    data = load(a.results)
    for p in problems(data):
        print(f"compat_docs: {p}", file=sys.stderr)
    text = render(data)
    if a.check:
        same = a.out.exists() and a.out.read_text(encoding="utf-8") == text
        print("compat_docs: up to date" if same else f"compat_docs: {a.out} is stale")
        return 0 if same else 1
    a.out.write_text(text, encoding="utf-8")
    print(f"compat_docs: wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
