"""Structured output: a GBNF grammar, a JSON schema and OpenAI's response_format
constrain what the real SmolLM2 generates, through a real server on 127.0.0.1.
Bad grammars and schemas are 400s and the server keeps serving."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest

from core.serve.grammar import Constraint, GrammarError, compile_grammar, request_constraint
from core.serve.sampling import SamplingParams, make_sampler
from tests.serving import running_engine, serving

CTX = 512

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(smollm_path):
    with running_engine(smollm_path, ctx_size=CTX, n_parallel=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with serving(engine) as srv:
        yield srv


def req(srv, method, path, body=None, raw: bytes | None = None):
    async def go():
        async with aiohttp.ClientSession() as s:
            data = raw if raw is not None else json.dumps(body) if body is not None else None
            async with s.request(method, srv.url + path, data=data) as r:
                text = await r.text()
                try:
                    return r.status, json.loads(text)
                except ValueError:
                    return r.status, text

    return asyncio.run(go())


def assert_400(status, body, *words):
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error"
    for w in words:
        assert w in body["error"]["message"], body


def check_person(v):
    """The PERSON schema, checked by hand (no validator library in the pins)."""
    assert isinstance(v, dict) and set(v) == {"name", "age", "pets"}, v
    assert isinstance(v["name"], str) and len(v["name"]) <= 12
    assert isinstance(v["age"], int) and not isinstance(v["age"], bool) and 0 <= v["age"] <= 150
    assert isinstance(v["pets"], list) and len(v["pets"]) <= 3
    assert all(isinstance(p, str) and len(p) <= 8 for p in v["pets"])


def test_gbnf_grammar_restricts_the_output_to_its_words(server):
    for seed in (1, 2, 3):
        st, body = req(
            server,
            "POST",
            "/completion",
            {
                "prompt": "Is the sky green? Answer:",
                "grammar": 'root ::= ("yes" | "no")',
                "temperature": 1.0,
                "seed": seed,
                "n_predict": 16,
            },
        )
        assert st == 200, body
        assert body["content"] in ("yes", "no"), body["content"]
        assert body["stop_type"] == "eos"  # the grammar ended: only EOS could follow


def test_json_schema_output_parses_and_validates(server):
    st, body = req(
        server,
        "POST",
        "/completion",
        {
            "prompt": "A person described as JSON:",
            "json_schema": PERSON,
            "temperature": 0,
            "n_predict": 96,
        },
    )
    assert st == 200, body
    check_person(json.loads(body["content"]))


def test_response_format_json_schema_on_chat_and_json_object(server):
    msgs = [{"role": "user", "content": "Describe a person called Ann with two pets."}]
    st, body = req(
        server,
        "POST",
        "/v1/chat/completions",
        {
            "messages": msgs,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON},
            },
            "temperature": 0.7,
            "seed": 5,
            "max_tokens": 96,
        },
    )
    assert st == 200, body
    check_person(json.loads(body["choices"][0]["message"]["content"]))

    st, body = req(
        server,
        "POST",
        "/v1/completions",
        {
            "prompt": "Some JSON:",
            "response_format": {"type": "json_object"},
            "temperature": 0,
            "max_tokens": 64,
        },
    )
    assert st == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["text"]), dict)


def test_grammar_is_kept_while_streaming(server):
    async def go():
        text = ""
        async with aiohttp.ClientSession() as s:
            body = {
                "prompt": "Count:",
                "grammar": 'root ::= [0-9]{3} "!"',
                "stream": True,
                "temperature": 0,
                "n_predict": 16,
            }
            async with s.post(server.url + "/completion", json=body) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: "):
                        text += json.loads(line[6:])["content"]
        return text

    text = asyncio.run(go())
    assert len(text) == 4 and text[:3].isdigit() and text[3] == "!", text


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"grammar": 'root ::= ("yes" | '}, ["invalid grammar"]),
        ({"grammar": "root ::= undefined_rule"}, ["invalid grammar"]),
        ({"grammar": 12}, ["grammar"]),
        ({"json_schema": {"type": "objectx"}}, ["invalid JSON schema"]),
        ({"json_schema": "{not json"}, ["json_schema"]),
        ({"json_schema": {"type": "object"}, "grammar": "root ::= 'a'"}, ["not both"]),
        ({"response_format": {"type": "xml"}}, ["response_format"]),
        ({"response_format": {"type": "json_schema", "json_schema": 3}}, ["json_schema"]),
        ({"response_format": "json"}, ["response_format"]),
    ],
)
def test_bad_grammars_and_schemas_are_400_and_the_server_keeps_serving(server, extra, words):
    st, body = req(server, "POST", "/completion", {"prompt": "hi", "n_predict": 2, **extra})
    assert_400(st, body, *words)
    st, body = req(
        server,
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra},
    )
    assert_400(st, body, *words)
    st, body = req(server, "POST", "/completion", {"prompt": "hi", "n_predict": 2})
    assert st == 200 and body["tokens_predicted"] == 2


def test_unconstrained_requests_build_no_constraint(engine):
    assert request_constraint({"prompt": "hi"}, engine.tokenizer) is None
    assert request_constraint({"response_format": {"type": "text"}}, engine.tokenizer) is None
    assert request_constraint({"grammar": ""}, engine.tokenizer) is None


def test_constraint_mask_and_sampler_on_the_real_vocabulary(engine):
    tok = engine.tokenizer
    g = compile_grammar("gbnf", 'root ::= "yes" | "no"', tok)
    c = Constraint(g, tok)
    mask = c.allowed(tok.vocab_size + 7)  # padded logits: the pad rows stay banned
    assert mask.shape == (tok.vocab_size + 7,) and not mask[tok.vocab_size :].any()
    texts = {tok.token_str(int(i)) for i in np.flatnonzero(mask)}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    # the mask wins over the logits, at temperature 0 too: the favourite token is banned
    logits = np.zeros(tok.vocab_size, dtype=np.float32)
    logits[tok.encode(" maybe")[0]] = 50.0
    sampler = make_sampler(SamplingParams(temperature=0), tok.eog_ids, Constraint(g, tok))
    out = []
    while True:
        t = sampler(logits, out)
        if tok.is_eog(t):
            break
        out.append(t)
    assert tok.decode(out) in ("yes", "no")


def test_compile_refuses_non_strings_and_huge_grammars(engine):
    with pytest.raises(GrammarError, match="json_schema must be a JSON object"):
        compile_grammar("json_schema", [1, 2], engine.tokenizer)
    with pytest.raises(GrammarError, match="too long"):
        compile_grammar("gbnf", 'root ::= "a"' + " " * (300 << 10), engine.tokenizer)


def _run(engine, prompt, params):
    events = list(engine.generate(prompt, params))
    return events[-1]


def test_constrained_requests_are_never_drafted_and_keep_the_grammar(engine):
    """Prompt-lookup drafting (on by default) would feed tokens past the mask: a
    constrained sequence never drafts, an unconstrained one on the same text does."""
    tok = engine.tokenizer
    prompt = tok.encode("1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3", add_special=True)
    sched = engine.scheduler
    assert engine.draft_max > 0
    before = sched.drafted
    plain = _run(engine, prompt, SamplingParams(temperature=0, n_predict=24, ignore_eos=True))
    assert sched.drafted > before  # this text does draft when unconstrained
    g = compile_grammar("gbnf", 'root ::= (" " [1-8])+ " 9"', tok)
    before = sched.drafted
    done = _run(engine, prompt, SamplingParams(temperature=0, n_predict=24, grammar=g))
    assert sched.drafted == before
    assert plain.stop_type == "limit" and done.content.strip()
    parts = done.content.split(" ")
    assert parts[0] == "" and all(p in "12345678" and len(p) == 1 for p in parts[1:-1])


def test_response_format_follows_llama_servers_rules(engine):
    tok = engine.tokenizer

    def rc(body):
        return request_constraint(body, tok)

    any_object = rc({"json_schema": {"type": "object"}})
    assert rc({"response_format": {"type": ""}}) is None  # an empty type is text
    assert rc({"response_format": {"type": "json_object"}}) == any_object
    assert rc({"response_format": {"type": "json_schema", "json_schema": {}}}) == any_object
    assert rc({"json_schema": {}}) == any_object  # an empty schema means any object
    # json_object without its own schema keeps the body's json_schema
    body = {"json_schema": PERSON, "response_format": {"type": "json_object"}}
    assert rc(body) == rc({"json_schema": PERSON}) != any_object
    body = {"json_schema": PERSON, "response_format": {"type": "json_object", "schema": {}}}
    assert rc(body) == any_object


def test_a_finished_grammar_ends_the_request_even_with_ignore_eos(engine):
    tok = engine.tokenizer
    g = compile_grammar("gbnf", 'root ::= "yes" | "no"', tok)
    prompt = tok.encode("Is water wet? Answer:", add_special=True)
    params = SamplingParams(temperature=0, n_predict=20, ignore_eos=True, grammar=g)
    done = _run(engine, prompt, params)
    assert done.stop_type == "eos" and done.content in ("yes", "no"), done
