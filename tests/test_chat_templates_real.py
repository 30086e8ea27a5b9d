"""The chat prompts of ten real model templates, as llama-server builds them (#19).

The templates are llama.cpp's own copies (``models/templates/*.jinja``) shipped in the
llama-cpp-python 0.3.36 sdist, plus the Mistral-7B-Instruct-v0.1 template that sdist's
``llama_chat_format.py`` carries. They are fetched once with pip into the user's cache
dir (only the template texts are kept) and never committed here.

Each template is rendered with the BOS/EOS texts and the add-BOS flag of its real model,
for a user-only, a system+user and a multi-turn conversation. The expected texts are
llama-server's, as its code builds them (common/chat.cpp, tools/server):
- the BOS a template writes first is cut when the vocabulary adds its own (Llama 3.2,
  R1-Distill-Llama, Gemma 2, Mistral v0.1 and Nemo: add_bos true), so the token list
  starts with one BOS;
- a template without a system role (Gemma 2, Mistral v0.1: they raise before reading
  the system text) gets the system text merged into the first user turn with "\\n";
- ``date_string`` is today ("%d %b %Y"), ``strftime_now`` works, ``enable_thinking`` is
  true (--reasoning auto), ``add_generation_prompt`` true.

``usage.prompt_tokens`` needs the model's vocabulary; these models are not downloaded,
so the served model is SmolLM2 and the count is of the same text tokenized the same way
(SmolLM2's tokenizer, add_special, parse_special): the point is that the text, and the
way it is turned into tokens, is llama-server's.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from datetime import date
from pathlib import Path

import aiohttp
import platformdirs
import pytest

from core.chat_template import ChatTemplate
from core.http import ServerSettings, ServerThread
from core.options import EngineOptions
from core.serve.engine import Engine

SDIST = "llama-cpp-python==0.3.36"
TEMPLATES_DIR = "vendor/llama.cpp/models/templates/"

# name -> (template file, BOS text, EOS text, the vocabulary adds BOS) of the real model
MODELS = {
    "llama32": ("meta-llama-Llama-3.2-3B-Instruct", "<|begin_of_text|>", "<|eot_id|>", True),
    "gemma2": ("google-gemma-2-2b-it", "<bos>", "<eos>", True),
    "phi35": ("microsoft-Phi-3.5-mini-instruct", "<s>", "<|endoftext|>", False),
    "qwen3": ("Qwen-Qwen3-0.6B", "<|endoftext|>", "<|im_end|>", False),
    "r1llama": (
        "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
        "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        True,
    ),
    "mistral01": ("mistral-v0.1", "<s>", "</s>", True),
    "nemo": ("mistralai-Mistral-Nemo-Instruct-2407", "<s>", "</s>", True),
    "granite33": (
        "ibm-granite-granite-3.3-2B-Instruct",
        "<|end_of_text|>",
        "<|end_of_text|>",
        False,
    ),
    "smollm3": ("HuggingFaceTB-SmolLM3-3B", "<|im_start|>", "<|im_end|>", False),
    "qwen25": ("Qwen-Qwen2.5-7B-Instruct", "<|endoftext|>", "<|im_end|>", False),
}

MESSAGES = {
    "user": [{"role": "user", "content": "Hello"}],
    "sys": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello"},
    ],
    "multi": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there."},
        {"role": "user", "content": "How are you?"},
    ],
}

SMOLLM3_DEFAULT = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your role "
    "as an assistant involves thoroughly exploring questions through a systematic "
    "thinking process before providing the final precise and accurate solutions. This"
    " requires engaging in a comprehensive cycle of analysis, summarizing, "
    "exploration, reassessment, reflection, backtracking, and iteration to develop "
    "well-considered thinking process. Please structure your response into two main "
    "sections: Thought and Solution using the specified format: <think> Thought "
    "section </think> Solution section. In the Thought section, detail your reasoning"
    " process in steps. Each step should include detailed considerations such as "
    "analysing questions, summarizing relevant findings, brainstorming new ideas, "
    "verifying the accuracy of the current steps, refining any errors, and revisiting"
    " previous steps. In the Solution section, based on various attempts, "
    "explorations, and reflections from the Thought section, systematically present "
    "the final solution that you deem correct. The Solution section should be "
    "logical, accurate, and concise and detail necessary steps needed to reach the "
    "conclusion."
)

# llama-server's /apply-template text for each model and conversation ({today} is
# date_string, {today_long} the "%B %d, %Y" Granite asks strftime_now for)
EXPECTED = {
    "llama32": {
        "user": "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: {today}\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "sys": "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: {today}\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "multi": "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: {today}\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    },
    "gemma2": {
        "user": "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
        "sys": "<start_of_turn>user\nYou are terse.\nHello<end_of_turn>\n<start_of_turn>model\n",
        "multi": "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\nHi there.<end_of_turn>\n<start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n",
    },
    "phi35": {
        "user": "<|user|>\nHello<|end|>\n<|assistant|>\n",
        "sys": "<|system|>\nYou are terse.<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\n",
        "multi": "<|user|>\nHello<|end|>\n<|assistant|>\nHi there.<|end|>\n<|user|>\nHow are you?<|end|>\n<|assistant|>\n",
    },
    "qwen3": {
        "user": "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        "sys": "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        "multi": "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there.<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n",
    },
    "r1llama": {
        "user": "<｜User｜>Hello<｜Assistant｜><think>\n",
        "sys": "You are terse.<｜User｜>Hello<｜Assistant｜><think>\n",
        "multi": "<｜User｜>Hello<｜Assistant｜>Hi there.<｜end▁of▁sentence｜><｜User｜>How are you?<｜Assistant｜><think>\n",
    },
    "mistral01": {
        "user": "[INST] Hello [/INST]",
        "sys": "[INST] You are terse.\nHello [/INST]",
        "multi": "[INST] Hello [/INST]Hi there.</s> [INST] How are you? [/INST]",
    },
    "nemo": {
        "user": "[INST]Hello[/INST]",
        "sys": "[INST]You are terse.\n\nHello[/INST]",
        "multi": "[INST]Hello[/INST]Hi there.</s>[INST]How are you?[/INST]",
    },
    "granite33": {
        "user": "<|start_of_role|>system<|end_of_role|>Knowledge Cutoff Date: April 2024. Today's Date: {today_long}. You are Granite, developed by IBM. You are a helpful AI assistant.<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Hello<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>",
        "sys": "<|start_of_role|>system<|end_of_role|>You are terse.<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Hello<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>",
        "multi": "<|start_of_role|>system<|end_of_role|>Knowledge Cutoff Date: April 2024. Today's Date: {today_long}. You are Granite, developed by IBM. You are a helpful AI assistant.<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Hello<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>Hi there.<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>How are you?<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>",
    },
    "smollm3": {
        "user": "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nReasoning Mode: /think\n\n## Custom Instructions\n\n"
        + SMOLLM3_DEFAULT
        + "\n\n<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        "sys": "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nReasoning Mode: /think\n\n## Custom Instructions\n\nYou are terse.\n\n<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        "multi": "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nReasoning Mode: /think\n\n## Custom Instructions\n\n"
        + SMOLLM3_DEFAULT
        + "\n\n<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there.<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n",
    },
    "qwen25": {
        "user": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        "sys": "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        "multi": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there.<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n",
    },
}


def _user_cache() -> Path:
    """The user's real cache dir (tests point MIXDESK_CACHE at a per-session folder),
    so the sdist is fetched once for every session to come, as the models are."""
    return Path(platformdirs.user_cache_dir("mixdesk")) / "llamacpp-templates-0.3.36"


def _fetch_templates(dest: Path) -> None:
    """pip download the sdist, keep only the template texts we test, move into place."""
    names = {f for f, *_ in MODELS.values()}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*cmd, SDIST, "-d", tmp], check=True, capture_output=True, timeout=900)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        out = Path(tmp) / "templates"
        out.mkdir()
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                _, _, inner = member.name.partition("/")
                stem = Path(inner).stem
                if inner.startswith(TEMPLATES_DIR) and stem in names and member.isfile():
                    (out / f"{stem}.jinja").write_bytes(tar.extractfile(member).read())
                elif inner == "llama_cpp/llama_chat_format.py":
                    src = tar.extractfile(member).read().decode("utf-8")
                    m = re.search(r"^MISTRAL_INSTRUCT_CHAT_TEMPLATE = (\".*\")$", src, re.M)
                    text = ast.literal_eval(m.group(1))
                    (out / "mistral-v0.1.jinja").write_text(text, encoding="utf-8")
        missing = names - {p.stem for p in out.iterdir()}
        assert not missing, f"templates not found in the sdist: {sorted(missing)}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = dest.parent / (dest.name + ".partial")
        shutil.rmtree(staged, ignore_errors=True)
        shutil.move(str(out), staged)
        staged.rename(dest)


@pytest.fixture(scope="session")
def llamacpp_templates() -> Path:
    dest = _user_cache()
    if not dest.is_dir():
        _fetch_templates(dest)
    return dest


def _template(folder: Path, key: str) -> ChatTemplate:
    fname, bos, eos, add_bos = MODELS[key]
    src = (folder / f"{fname}.jinja").read_text(encoding="utf-8")
    return ChatTemplate(src, bos, eos, add_bos=add_bos)


def _expected(key: str, conv: str) -> str:
    today = date.today()
    text = EXPECTED[key][conv]
    text = text.replace("{today}", today.strftime("%d %b %Y"))
    return text.replace("{today_long}", today.strftime("%B %d, %Y"))


@pytest.fixture(scope="module")
def served(smollm_path):
    eng = Engine(EngineOptions(ctx_size=1024, n_parallel=1))
    eng.load_model(smollm_path)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0)).start()
    srv.engine = eng
    yield srv
    srv.stop()
    eng.stop()


async def _post(srv, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.url + path, data=json.dumps(body)) as r:
            return r.status, json.loads(await r.text())


@pytest.mark.parametrize("key", list(MODELS))
def test_prompt_text_and_tokens_match_llama_server(key, llamacpp_templates, served):
    eng = served.engine
    original, eng.chat_template = eng.chat_template, _template(llamacpp_templates, key)
    try:
        for conv, messages in MESSAGES.items():
            want = _expected(key, conv)
            status, body = asyncio.run(_post(served, "/apply-template", {"messages": messages}))
            assert status == 200, body
            assert body["prompt"] == want, f"{key}/{conv}"
            status, body = asyncio.run(
                _post(
                    served,
                    "/v1/chat/completions",
                    {"messages": messages, "max_tokens": 1, "temperature": 0},
                )
            )
            assert status == 200, body
            n = len(eng.tokenizer.encode(want, add_special=True, parse_special=True))
            assert body["usage"]["prompt_tokens"] == n, f"{key}/{conv}"
    finally:
        eng.chat_template = original


def test_template_probe_finds_the_templates_without_a_system_role(llamacpp_templates):
    """Gemma 2 and Mistral v0.1 refuse a system message before reading it: they are
    the ones llama-server's capability probe marks as without a system role."""
    no_system = {k for k in MODELS if not _template(llamacpp_templates, k).supports_system_role}
    assert no_system == {"gemma2", "mistral01"}


def test_bos_written_by_the_template_is_cut_once(llamacpp_templates):
    """Double BOS (#19): with a vocabulary that adds BOS, the BOS text Llama 3.2 writes
    is cut; with one that does not, the text keeps it (llama-server cuts only then)."""
    from core.chat_template import build_prompt

    fname, bos, eos, _ = MODELS["llama32"]
    src = (llamacpp_templates / f"{fname}.jinja").read_text(encoding="utf-8")
    msgs = MESSAGES["user"]
    assert not build_prompt(ChatTemplate(src, bos, eos, add_bos=True), msgs).startswith(bos)
    assert build_prompt(ChatTemplate(src, bos, eos, add_bos=False), msgs).startswith(bos)
