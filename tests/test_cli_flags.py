"""llama-server's flags as llama-server means them (issue #20): the sampling flags set
the server's defaults, -c is the total context divided across -np slots, short flags
llama-server users type are honoured or refused by name, --host binds every address
of a list, --alias/--tags fill /v1/models.

Parser-level checks run core.cli.parse_args directly; one real ``main.py --headless``
(SmolLM2, 127.0.0.1) checks that the flags reach the running server.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_http_headless import REPO, free_port, http, start, stop, wait_healthy

from core.cli import parse_args
from core.errors import UserError
from core.http.app import ServerSettings
from core.options import DEFAULT_CTX, EngineOptions, OptionsError


def usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# ---- parser --------------------------------------------------------------------------


def test_ctx_is_the_total_divided_across_slots():
    assert parse_args(["-c", "512", "-np", "2"]).ctx_size == 256
    assert parse_args(["-c", "512", "-np", "2", "--kv-unified"]).ctx_size == 512
    assert parse_args(["-c", "0", "-np", "2"]).ctx_size == 0  # the model's, per slot
    assert parse_args(["-np", "3"]).ctx_size == DEFAULT_CTX  # not given: per slot
    assert EngineOptions.from_args(parse_args(["-c", "1024", "-np", "4"])).ctx_size == 256


def test_ctx_too_small_for_the_slots_is_refused(capsys):
    err = usage_error(["-c", "10", "-np", "4"], capsys)
    assert "--ctx-size 10" in err and "--parallel 4" in err
    assert "must be >= 0" in usage_error(["-c", "-5"], capsys)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["-ctk", "q8_0"], "-ctk q8_0"),
        (["-ctv", "q4_0"], "-ctv q4_0"),
        (["-hf", "org/model"], "-hf/-hfr/--hf-repo"),
        (["-hff", "x.gguf"], "-hff/--hf-file"),
        (["-md", "draft.gguf"], "-md/--model-draft"),
        (["--mmproj", "p.gguf"], "--mmproj"),
        (["-xyz"], "unknown flag -xyz"),
        (["-c512"], "unknown flag -c512"),
    ],
)
def test_llama_server_flags_we_lack_are_refused_by_name(argv, named, capsys):
    # -ctk q8_0 used to be read as "-c tk" and -hf as -h (help)
    err = usage_error(argv, capsys)
    assert named in err
    assert "invalid int value" not in err


def test_kv_cache_types_reach_the_engine_options(capsys):
    """-ctk/-ctv f16 are honoured now (keys and values stored as float16): no notice,
    and each flag reaches EngineOptions apart; without them the cache stays f32."""
    a = parse_args(["-ctk", "f16", "-ctv", "f32"])
    assert a.cache_type_k == "f16" and a.cache_type_v == "f32"
    assert "-ctk" not in capsys.readouterr().err
    o = EngineOptions.from_args(a)
    assert (o.cache_type_k, o.cache_type_v) == ("f16", "f32")
    o = EngineOptions.from_args(parse_args([]))
    assert (o.cache_type_k, o.cache_type_v) == ("f32", "f32")


@pytest.mark.parametrize(
    "argv,named",
    [(["-ctk", "q8_0"], "-ctk q8_0"), (["-ctv", "bf16"], "-ctv bf16"),
     (["--cache-type-v", "q4_0"], "-ctv q4_0")],
)  # fmt: skip
def test_kv_cache_types_we_lack_are_refused_by_name(argv, named, capsys):
    err = usage_error(argv, capsys)
    assert f"{named}: not supported; the KV cache holds f32 or f16" in err


def test_engine_options_refuse_a_kv_cache_type_we_lack():
    with pytest.raises(OptionsError, match="-ctk q8_0: not supported"):
        EngineOptions(cache_type_k="q8_0")


def test_negative_numbers_are_values_not_flags():
    a = parse_args(["--seed", "-1", "--lora-scaled", "a.gguf", "-0.5", "-n", "-1"])
    assert a.seed == -1 and a.adapters == [("a.gguf", -0.5)] and a.n_predict == -1


@pytest.mark.parametrize(
    "argv",
    [
        ["-fa", "on"],
        ["-ngl", "99"],
        ["-cb"],
        ["-b", "512", "-ub", "128"],
        ["--batch-size", "64", "--ubatch-size", "32"],
        ["--no-slots"],
        ["--slots", "--metrics", "--embedding", "--pooling", "cls"],
        ["--jinja"],
        ["--no-context-shift"],
        ["--context-shift"],
        ["-to", "30"],
        ["-rea", "off"],
        ["--predict", "12"],
        ["--webui"],
        ["--no-webui"],
        ["--no-ui"],
    ],
)
def test_accepted_llama_server_flags(argv):
    parse_args(argv)


def test_web_ui_flags():
    # llama-server's --webui / --no-webui, and --no-ui as llama.cpp's own tests spell it
    assert parse_args([]).webui is True
    assert parse_args(["--no-webui"]).webui is False
    assert parse_args(["--no-ui"]).webui is False
    assert parse_args(["--no-ui", "--webui"]).webui is True
    assert ServerSettings.from_args(parse_args(["--no-ui"])).webui is False


def test_flag_values_out_of_range_are_refused(capsys):
    assert "--batch-size" in usage_error(["-b", "0"], capsys)
    assert "--timeout" in usage_error(["-to", "0"], capsys)
    assert "--seed" in usage_error(["--seed", "-7"], capsys)
    assert "--repeat-last-n" in usage_error(["--repeat-last-n", "-2"], capsys)
    assert "--pooling" in usage_error(["--pooling", "max"], capsys)
    assert "--slot-save-path" in usage_error(["--slot-save-path", "/no/such/dir"], capsys)


def test_sampling_flags_are_the_server_defaults():
    a = parse_args(
        [
            "--temp",
            "0.3",
            "--top-k",
            "7",
            "--top-p",
            "0.5",
            "--min-p",
            "0.2",
            "--repeat-penalty",
            "1.1",
            "--repeat-last-n",
            "32",
            "--presence-penalty",
            "0.4",
            "--frequency-penalty",
            "0.6",
            "-s",
            "1234",
            "-n",
            "9",
        ]
    )
    p = ServerSettings.from_args(a).sampling
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.3, 7, 0.5, 0.2)
    assert (p.repeat_penalty, p.repeat_last_n) == (1.1, 32)
    assert (p.presence_penalty, p.frequency_penalty) == (0.4, 0.6)
    assert (p.seed, p.n_predict) == (1234, 9)
    assert ServerSettings.from_args(parse_args(["-s", "-1"])).sampling.seed is None


def test_a_meaningless_sampling_flag_is_a_user_error():
    with pytest.raises(UserError, match="presence_penalty"):
        ServerSettings.from_args(parse_args(["--presence-penalty", "1e9"]))


def test_alias_list_tags_hosts_and_timeout():
    a = parse_args(
        ["--alias", "two, one", "--tags", "a,b", "--host", "127.0.0.1,127.0.0.2", "-to", "9"]
    )
    s = ServerSettings.from_args(a)
    # llama-server's sorted set of aliases: the id is the first in that order
    assert s.alias == "one" and s.aliases == ["one", "two"] and s.tags == ["a", "b"]
    assert s.hosts == ["127.0.0.1", "127.0.0.2"] and s.body_timeout == 9.0


def test_hf_is_not_read_as_help():
    r = subprocess.run(
        [sys.executable, "main.py", "--headless", "-hf", "org/model"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--hf-repo" in r.stderr and "usage:" not in r.stdout


# ---- a real headless server ----------------------------------------------------------


@pytest.fixture(scope="module")
def flagged(smollm_path):
    port = free_port()
    proc = start(
        [
            "-m",
            str(smollm_path),
            "--port",
            str(port),
            "--host",
            "127.0.0.1,127.0.0.2",
            "-c",
            "512",
            "-np",
            "2",
            "--temp",
            "0.9",
            "--top-k",
            "50",
            "--seed",
            "42",
            "-n",
            "6",
            "--alias",
            "smol,smol-135m",
            "--tags",
            "tiny,test",
        ]
    )
    try:
        wait_healthy(proc, port)
        yield port
    finally:
        err = stop(proc)
        assert proc.returncode == 0, err


def test_props_show_the_flag_defaults_and_per_slot_context(flagged):
    st, props = http(flagged, "GET", "/props")
    assert st == 200
    d = props["default_generation_settings"]
    assert d["n_ctx"] == 256 and props["total_slots"] == 2
    p = d["params"]
    assert (p["temperature"], p["top_k"], p["seed"], p["n_predict"]) == (0.9, 50, 42, 6)
    assert props["model_alias"] == "smol"


def test_server_seed_makes_requests_without_a_seed_repeat(flagged):
    body = {"prompt": "Once upon a time", "ignore_eos": True}
    outs = [http(flagged, "POST", "/completion", body)[1] for _ in range(2)]
    assert outs[0]["tokens_predicted"] == 6  # -n is the default n_predict
    assert outs[0]["content"] == outs[1]["content"]
    assert outs[0]["generation_settings"]["temperature"] == 0.9
    # a request's own fields still win over the flags
    st, own = http(flagged, "POST", "/completion", {**body, "n_predict": 2, "temperature": 0})
    assert st == 200 and own["tokens_predicted"] == 2
    assert own["generation_settings"]["temperature"] == 0


def test_models_list_aliases_and_tags(flagged):
    st, models = http(flagged, "GET", "/v1/models")
    base = models["data"][0]
    assert base["id"] == "smol"
    assert base["aliases"] == ["smol", "smol-135m"] and base["tags"] == ["tiny", "test"]


def test_every_host_of_the_list_is_bound(flagged):
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.2:{flagged}/health", timeout=30) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}


def test_overflow_uses_llama_servers_error(flagged):
    st, out = http(flagged, "POST", "/completion", {"prompt": "word " * 400, "n_predict": 1})
    assert st == 400
    e = out["error"]
    assert e["type"] == "exceed_context_size_error"
    assert "exceeds the available context size" in e["message"]
    assert e["n_ctx"] == 256 and e["n_prompt_tokens"] > 256


def test_context_shift_is_off_unless_asked():
    assert parse_args([]).context_shift is False
    assert parse_args(["--context-shift"]).context_shift is True
    assert parse_args(["--context-shift", "--no-context-shift"]).context_shift is False


# ---- --help (issue #33, item 6) ----------------------------------------------------------


def flag_help() -> dict[str, str]:
    """Each option's help text, by its longest name, as ``--help`` prints it."""
    from core.cli import build_parser

    return {
        max(a.option_strings, key=len): a.help or ""
        for a in build_parser()._actions
        if a.option_strings and a.help != "==SUPPRESS=="
    }


def test_every_flag_says_what_it_does():
    undocumented = [flag for flag, text in flag_help().items() if not text]
    assert undocumented == []  # --host, --port and most sampling flags once had no help


def test_help_matches_what_the_flags_do_today():
    h = flag_help()
    # save and restore work (tests/test_slots.py); the text once said they answer 501
    assert "save|restore" in h["--slot-save-path"] and "501: Mixdesk" not in h["--slot-save-path"]
    # -b and -ub set the prompt step (prefill_chunk); the text once said "no effect"
    for flag in ("--batch-size", "--ubatch-size"):
        assert "no effect" not in h[flag] and "min(-b, -ub)" in h["--batch-size"]
    # -t also sizes the engine's own threads, not only BLAS's
    assert "engine" in h["--threads"]
    # the id is the first alias in sorted order (test_alias_list_tags_hosts_and_timeout)
    assert "sorted" in h["--alias"]
