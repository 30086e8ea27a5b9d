"""Chat template tests: SmolLM2's own template against the prompts llama.cpp was
given, the ChatML fallback, and the sandbox against hostile templates."""

from __future__ import annotations

import logging
import re

import pytest

from core.chat_template import ChatTemplate, ChatTemplateError, RenderLimits  # noqa: E402
from core.tokenizer import Tokenizer  # noqa: E402

SMOLLM_DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n"
)
_CHATML_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n", re.S)
_GENERATION_PROMPT = "<|im_start|>assistant\n"


def _parse_chatml(prompt: str) -> list[dict]:
    """Messages back out of a ChatML prompt that ends with the generation prompt."""
    assert prompt.endswith(_GENERATION_PROMPT)
    body = prompt[: -len(_GENERATION_PROMPT)]
    messages = [{"role": r, "content": c} for r, c in _CHATML_TURN.findall(body)]
    assert _CHATML_TURN.sub("", body) == "", "prompt is not plain ChatML"
    return messages


@pytest.fixture(scope="module")
def smollm_template(smollm_meta) -> ChatTemplate:
    return ChatTemplate.from_metadata(smollm_meta, Tokenizer.from_metadata(smollm_meta))


def _chat_prompts(reference) -> list[str]:
    prompts = dict.fromkeys(g["prompt"] for g in reference["greedy"])  # unique, in order
    return [p for p in prompts if p.startswith("<|im_start|>")]


def test_smollm_renders_reference_prompt_with_system(smollm_template, reference):
    with_system = [p for p in _chat_prompts(reference) if p.startswith("<|im_start|>system")]
    assert with_system, "reference has no chat prompt with a system message"
    for prompt in with_system:
        assert smollm_template.render(_parse_chatml(prompt)) == prompt


def test_smollm_inserts_default_system_prompt(smollm_template, reference):
    user_only = [p for p in _chat_prompts(reference) if p.startswith("<|im_start|>user")]
    assert user_only, "reference has no chat prompt without a system message"
    for prompt in user_only:
        assert smollm_template.render(_parse_chatml(prompt)) == SMOLLM_DEFAULT_SYSTEM + prompt


def test_smollm_template_facts(smollm_template):
    assert not smollm_template.is_fallback
    assert (smollm_template.bos_token, smollm_template.eos_token) == ("<|im_start|>", "<|im_end|>")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert smollm_template.render(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    )


def test_content_parts_are_joined(smollm_template):
    parts = [
        {"type": "text", "text": "one"},
        {"type": "image_url", "image_url": {}},
        {"type": "text", "text": "two"},
    ]
    rendered = smollm_template.render(
        [{"role": "system", "content": "S"}, {"role": "user", "content": parts}]
    )
    assert "<|im_start|>user\none\ntwo<|im_end|>\n" in rendered


def test_bos_eos_come_from_tokenizer(smollm_meta):
    meta = {**smollm_meta, "tokenizer.chat_template": "{{ bos_token }}|{{ eos_token }}"}
    tmpl = ChatTemplate.from_metadata(meta, Tokenizer.from_metadata(smollm_meta))
    assert tmpl.render([]) == "<|im_start|>|<|im_end|>"


# --- fallback -----------------------------------------------------------------------------


@pytest.mark.parametrize("source", [None, ""])
def test_missing_template_falls_back_to_chatml_with_warning(caplog, source):
    with caplog.at_level(logging.WARNING, logger="core.chat_template"):
        tmpl = ChatTemplate(source)
    assert tmpl.is_fallback
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "ChatML" in caplog.text
    msgs = [{"role": "user", "content": "hi"}]
    assert tmpl.render(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tmpl.render(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_from_metadata_without_template_falls_back(caplog):
    with caplog.at_level(logging.WARNING, logger="core.chat_template"):
        assert ChatTemplate.from_metadata({}).is_fallback
    assert "ChatML" in caplog.text


# --- untrusted templates ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",  # would render as "" in a default sandbox
        "{{ cycler.__init__.__globals__.os.system('true') }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{% set d = {} %}{{ d.update({'a': 1}) }}",
    ],
    ids=["mro", "class", "globals", "list-append", "dict-update"],
)
def test_sandbox_violations_raise(source):
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_sandbox_blocks_side_effects(tmp_path):
    marker = tmp_path / "pwned"
    messages = [{"role": "user", "content": "hi"}]
    for hostile in [
        "{% set _ = messages.append({'role': 'injected'}) %}",
        "{{ cycler.__init__.__globals__.os.popen('touch " + str(marker) + "').read() }}",
    ]:
        with pytest.raises(ChatTemplateError):
            ChatTemplate(hostile).render(messages)
    assert not marker.exists()
    assert messages == [{"role": "user", "content": "hi"}]


def test_raise_exception_becomes_chat_template_error():
    tmpl = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation must start with a user turn') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="Conversation must start with a user turn"):
        tmpl.render([{"role": "assistant", "content": "hi"}])


def test_runtime_and_syntax_errors_become_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        ChatTemplate("{{ 1 / 0 }}").render([])
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for %}")


def test_helpers_available():
    out = ChatTemplate(
        "{{ strftime_now('%Y') }}|{{ {'a': '<b>'} | tojson }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "|{{ m.content }}{% endfor %}"
    ).render([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])
    year, as_json, first = out.split("|")
    assert year.isdigit() and len(year) == 4
    assert as_json == '{"a": "<b>"}'  # HF's tojson: no HTML escaping
    assert first == "x"


def test_extra_variables_reach_template():
    tmpl = ChatTemplate("{{ tools | length }}{{ add_generation_prompt }}")
    assert tmpl.render([], tools=[{"name": "t"}], add_generation_prompt=True) == "1True"
    # llama-server sets add_generation_prompt only when true: false leaves it undefined
    assert tmpl.render([], tools=[{"name": "t"}], add_generation_prompt=False) == "1"


# --- render limits: time and size ----------------------------------------------------------

FAST = RenderLimits(seconds=0.5)
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "source",
    [
        # 10^10 iterations of loops that call nothing: only the line tracer sees them
        "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}",
        "{% for a in range(99999) %}{% for b in range(99999) %}{{ loop.index }}"
        "{% endfor %}{% endfor %}",
    ],
    ids=["empty-loops", "loop-index"],
)
def test_endless_template_stops_at_the_deadline(source):
    with pytest.raises(ChatTemplateError, match="longer than 0.5 s"):
        ChatTemplate(source, limits=FAST).render(HI)


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'x' * 10**9 }}",
        "{{ ['x'] * 10**9 }}",
        "{{ 10 ** (10 ** 10) }}",
        "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
        "{% endfor %}{{ ns.x }}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
        "{{ 'x'|center(1000000000) }}",
        "{{ ['x']|join('y' * 1000000000) }}",
        "{{ 'x'.ljust(1000000000) }}",
        "{{ '{:>1000000000}'.format('x') }}",
        "{{ '{a:>1000000000}'.format_map({'a': 1}) }}",
        "{{ '%1000000000s' % 'x' }}",
        "{{ '%*s' % (1000000000, 'x') }}",
        "{{ lipsum(n=1000000000) }}",
        "{% for a in range(99999) %}{{ 'y' * 100 }}{% endfor %}",  # 10 MB of output
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    ],
    ids=[
        "str-times",
        "list-times",
        "power",
        "squaring",
        "tilde-doubling",
        "plus-doubling",
        "center-filter",
        "join-filter",
        "ljust-method",
        "format-width",
        "format-map-width",
        "percent-width",
        "percent-star",
        "lipsum",
        "output",
        "recursion",
    ],
)
def test_oversized_template_is_refused_before_building_it(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source, limits=FAST).render(HI)


def test_size_budget_grows_with_the_conversation(smollm_template):
    long = "word " * 400_000  # 2 M characters: over the fixed budget, under 4x the input
    out = smollm_template.render([{"role": "user", "content": long}])
    assert long in out
    limited = ChatTemplate("{{ messages[0]['content'] * 5 }}", limits=FAST)
    with pytest.raises(ChatTemplateError, match="over the limit"):
        limited.render([{"role": "user", "content": long}])


def test_render_limits_are_per_thread():
    """Two renders on two threads: the endless one stops, the normal one is unaffected."""
    import threading

    slow = ChatTemplate(
        "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}",
        limits=FAST,
    )
    errors: list[Exception] = []

    def endless():
        try:
            slow.render(HI)
        except ChatTemplateError as e:
            errors.append(e)

    t = threading.Thread(target=endless)
    t.start()
    assert (
        ChatTemplate(None).render(HI) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    t.join(30)
    assert len(errors) == 1 and "longer than" in str(errors[0])


@pytest.mark.parametrize("value", [42, 1.5, ["{{ x }}"], b"tmpl"])
def test_non_text_template_in_metadata_falls_back_to_chatml(caplog, value):
    with caplog.at_level(logging.WARNING, logger="core.chat_template"):
        tmpl = ChatTemplate.from_metadata({"tokenizer.chat_template": value})
    assert tmpl.is_fallback and "not text" in caplog.text
    assert tmpl.render(HI).startswith("<|im_start|>user\nhi")


# --- the prompt as llama-server builds it (build_prompt, #19) ------------------------------

from core.chat_template import (  # noqa: E402
    BUILTIN_TEMPLATES,
    ChatDefaults,
    build_prompt,
    encode_prompt,
    resolve_template_arg,
)

THINKING = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>"
    "{% if not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


def test_gemma3_prompt_has_one_bos(gemma3_meta):
    """Double BOS: Gemma 3's template writes {{ bos_token }} and its vocabulary adds
    BOS; llama-server cuts the template's, so the tokens start with one BOS."""
    from core.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(gemma3_meta)
    tmpl = ChatTemplate.from_metadata(gemma3_meta, tok)
    ids = encode_prompt(tok, build_prompt(tmpl, [{"role": "user", "content": "Hi"}]))
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id


def test_undefined_names_render_empty_but_unsafe_attributes_still_raise():
    """firefunction-v2 concatenates an undefined ``functions``: blank, as in llama-server."""
    t = ChatTemplate("{{ 'a' + functions }}|{{ functions.x.y }}|{{ none_var + 'b' }}")
    assert t.render([]) == "a||b"
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate("{{ functions.__class__ }}").render([])


def test_enable_thinking_from_reasoning_switch_and_request_kwargs():
    t = ChatTemplate(THINKING)
    msgs = [{"role": "user", "content": "Hi"}]
    assert build_prompt(t, msgs).endswith("<assistant>")  # auto: thinking on
    off = ChatDefaults(reasoning="off")
    assert build_prompt(t, msgs, defaults=off).endswith("<think></think>")
    on = build_prompt(t, msgs, defaults=off, template_kwargs={"enable_thinking": True})
    assert on.endswith("<assistant>")  # the request's kwargs win
    with pytest.raises(ChatTemplateError, match="enable_thinking"):
        build_prompt(t, msgs, template_kwargs={"enable_thinking": "false"})


def test_date_tools_and_kwargs_reach_the_template():
    t = ChatTemplate("{{ date_string }}|{{ tools[0].function.name }}|{{ who }}")
    out = build_prompt(
        t,
        [{"role": "user", "content": "x"}],
        tools=[{"type": "function", "function": {"name": "f"}}],
        template_kwargs={"who": "me"},
    )
    from datetime import date

    assert out == f"{date.today().strftime('%d %b %Y')}|f|me"


def test_trailing_assistant_message_is_continued():
    t = ChatTemplate(None)  # ChatML
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}]
    want = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nSure, "
    assert build_prompt(t, msgs) == want
    # --no-prefill-assistant: a finished turn, then the generation prompt
    done = build_prompt(t, msgs, defaults=ChatDefaults(prefill_assistant=False))
    assert done.endswith("Sure, <|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "messages,kw,match",
    [
        (
            [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
            {},
            "2 or more assistant",
        ),
        ([{"role": "user", "content": "a"}], {"continue_final_message": True}, "both"),
    ],
)
def test_prefill_requests_llama_server_refuses(messages, kw, match):
    with pytest.raises(ChatTemplateError, match=match):
        build_prompt(ChatTemplate(None), messages, **kw)


def test_system_role_polyfill_merges_into_first_user_turn():
    src = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
        "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    )
    t = ChatTemplate(src)
    assert not t.supports_system_role
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert build_prompt(t, msgs, add_generation_prompt=False) == "[user:S\nU]"
    assert ChatTemplate(None).supports_system_role


def test_builtin_names_and_inline_templates():
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "V"},
    ]

    def fmt(name):
        return build_prompt(ChatTemplate(resolve_template_arg(name)), msgs)

    assert fmt("llama3") == (
        "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nV<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert fmt("gemma") == (
        "<start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
        "<start_of_turn>user\nV<end_of_turn>\n<start_of_turn>model\n"
    )
    assert fmt("mistral-v1") == " [INST] S\n\nU [/INST] A</s> [INST] V [/INST]"
    assert (
        fmt("mistral-v7") == "[SYSTEM_PROMPT] S[/SYSTEM_PROMPT][INST] U[/INST] A</s>[INST] V[/INST]"
    )
    assert fmt("phi3").endswith("<|user|>\nV<|end|>\n<|assistant|>\n")
    assert set(BUILTIN_TEMPLATES) >= {"chatml", "llama2", "zephyr", "deepseek3", "mistral-v3"}
    assert resolve_template_arg("{{ 'x' }}") == "{{ 'x' }}"
    with pytest.raises(ChatTemplateError, match="built-in"):
        resolve_template_arg("llama9")
