"""The X/Y grid of mixes (#21): core/grid.py on the real SmolLM2 with the llama.cpp
reference adapters, and POST /mixdesk/grid on a real server (127.0.0.1) driven by a
real aiohttp client.

One engine for the module (8 slots); adapters 0 and 1 are lora_attn and lora_ffn at
global scale 0. Greedy, short generations (n_predict <= 8) keep it cheap.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import re
import threading

import aiohttp
import pytest

from core import grid as G
from core.http import ServerSettings, ServerThread
from core.lora.mix import mix_text
from core.serve.events import RequestFinished
from core.serve.sampling import SamplingParams
from tests.serving import running_engine, serving

CTX = 256
N = 6  # tokens per cell
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def eng(smollm_path, ref_dir):
    adapters = [ref_dir / "adapters" / n for n in ("lora_attn.gguf", "lora_ffn.gguf")]
    with running_engine(smollm_path, adapters=adapters, ctx_size=CTX, n_parallel=8) as e:
        yield e


@pytest.fixture(scope="module")
def server(eng):
    with serving(eng) as srv:
        yield srv


@pytest.fixture(scope="module")
def names(eng):
    return {a["id"]: a["name"] for a in eng.adapters()}


def greedy(n: int = N, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, n_predict=n, ignore_eos=True, **kw)


# ---- cells -----------------------------------------------------------------------------


def test_cells_are_x_by_y_with_presets_then_scales(names):
    spec = G.GridSpec(
        G.Axis("scale", (0.0, 0.5, 1.0), adapter=1),
        G.Axis("preset", ("soft", "hard")),
        greedy(),
        messages=MESSAGES,
        presets={"soft": {0: 0.25, 1: 0.75}, "hard": {0: 1.5}},
    )
    G.check_spec(spec, names)
    cells = G.cells(spec, {0: 0.1, 1: 0.2}, names)
    assert [(c.index, c.x, c.y) for c in cells] == [
        (j * 3 + i, i, j) for j in range(2) for i in range(3)
    ]
    # the preset gives the whole mix (unlisted adapters 0), then adapter 1's scale
    assert [c.mix for c in cells] == [
        {0: 0.25, 1: 0.0},
        {0: 0.25, 1: 0.5},
        {0: 0.25, 1: 1.0},
        {0: 1.5, 1: 0.0},
        {0: 1.5, 1: 0.5},
        {0: 1.5, 1: 1.0},
    ]
    assert cells[4].x_label == "lora_ffn ×0.5" and cells[4].y_label == "hard"


def test_unvaried_adapters_keep_the_current_mix_and_seed_varies_params(names):
    spec = G.GridSpec(G.Axis("seed", (7, 8)), None, greedy(), messages=MESSAGES)
    cells = G.cells(spec, {0: 0.3, 1: -0.5}, names)
    assert [c.mix for c in cells] == [{0: 0.3, 1: -0.5}] * 2
    assert [c.params.seed for c in cells] == [7, 8]
    assert cells[0].params.n_predict == N and cells[1].y_label == ""


@pytest.mark.parametrize(
    "spec, message",
    [
        (G.GridSpec(G.Axis("scale", (), 0), messages=MESSAGES), "x has no values"),
        (
            G.GridSpec(G.Axis("scale", tuple(range(9)), 0), G.Axis("seed", tuple(range(8)))),
            "72 cells is too large (at most 64)",
        ),
        (G.GridSpec(G.Axis("scale", (1.0,), 5)), "no adapter with id 5"),
        (G.GridSpec(G.Axis("scale", (0.5, float("nan")), 0)), "finite number"),
        (G.GridSpec(G.Axis("scale", (float("inf"),), 0)), "finite number"),
        (G.GridSpec(G.Axis("preset", ("nope",))), "unknown preset 'nope'"),
        (G.GridSpec(G.Axis("seed", (1, -2))), "a seed must be an integer"),
        (
            G.GridSpec(G.Axis("scale", (1.0,), 0), G.Axis("scale", (0.0,), 0)),
            "vary the same thing",
        ),
    ],
)
def test_bad_specs_are_user_errors(names, spec, message):
    with pytest.raises(G.GridError, match=message.replace("(", r"\(").replace(")", r"\)")):
        G.check_spec(spec, names)


# ---- running -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ran(eng):
    """A 3 × 2 grid (scale of lora_attn × lora_ffn on/off), greedy."""
    spec = G.GridSpec(
        G.Axis("scale", (0.0, 0.5, 1.0), adapter=0),
        G.Axis("scale", (0.0, 1.0), adapter=1),
        greedy(),
        messages=MESSAGES,
    )
    streamed: dict[int, str] = {}
    lock = threading.Lock()

    def on_event(i, ev):
        if getattr(ev, "kind", "") == "token":
            with lock:
                streamed[i] = streamed.get(i, "") + ev.text

    run, results = G.run_grid(eng, spec, on_event=on_event, timeout=600)
    return spec, run, results, streamed


def test_grid_cells_are_admitted_in_one_scheduler_step(ran):
    spec, run, results, streamed = ran
    assert len(run.requests) == 6
    steps = {r.admitted_step for r in run.requests}
    assert len(steps) == 1 and steps != {-1}  # all six started in the same step
    assert [r.cell.index for r in results] == list(range(6))
    for r in results:
        assert r.stop == "limit" and r.tokens == N and r.tok_s > 0
        assert streamed[r.cell.index] == r.text  # the stream adds up to the reply


def test_greedy_cell_equals_the_same_mix_run_alone(eng, ran):
    spec, run, results, _ = ran
    prompt = G.encode(eng, spec)
    for r in (results[1], results[5]):  # two of the six mixes: each alone costs a run
        alone = eng.complete(prompt, r.cell.params, mix=r.cell.mix)
        assert alone.mix == run.requests[r.cell.index].mix  # the same mix key
        assert alone.content == r.text, r.cell.mix
    # the mixes really differ: the adapters change the reply somewhere in the grid
    assert len({r.text for r in results}) > 1


def test_more_cells_than_slots_run_in_waves(eng):
    spec = G.GridSpec(G.Axis("seed", tuple(range(10))), None, greedy(2), messages=MESSAGES)
    run, results = G.run_grid(eng, spec, timeout=600)
    first = min(r.admitted_step for r in run.requests)
    in_first = [r for r in run.requests if r.admitted_step == first]
    assert len(in_first) == eng.n_parallel == 8  # a full batch, the rest queued
    assert all(r.stop == "limit" and r.tokens == 2 for r in results)


# ---- exports -------------------------------------------------------------------------------


def test_csv_export_parses_back_with_quotes_commas_and_newlines(ran, names):
    spec, _, results, _ = ran
    tricky = G.CellResult(results[0].cell, 'a, "quoted"\nsecond line', 3, 1.5, "eos")
    rows = list(csv.DictReader(io.StringIO(G.to_csv("p, q", [tricky, *results[1:]], names))))
    assert len(rows) == 6
    assert rows[0]["reply"] == 'a, "quoted"\nsecond line' and rows[0]["prompt"] == "p, q"
    assert rows[1]["mix"] == "lora_attn ×0.50" and rows[3]["mix"] == "lora_ffn ×1.00"
    assert [r["reply"] for r in rows[1:]] == [r.text for r in results[1:]]
    assert set(rows[0]) == set(G.CSV_COLUMNS)


def test_markdown_export_has_a_row_per_cell(ran, names):
    spec, _, results, _ = ran
    tricky = G.CellResult(results[0].cell, "a | b\nc", 3, 1.5, "eos")
    md = G.to_markdown(spec.prompt_text, [tricky, *results[1:]], names, spec)
    rows = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 6
    assert "a \\| b<br>c" in rows[0]  # one table row, its pipe escaped
    assert "scale of lora_attn" in md and "Name a colour." in md
    for r, row in zip(results, rows):
        assert f"| {r.cell.index} |" in row


# ---- HTTP ----------------------------------------------------------------------------------


def run_async(coro):
    return asyncio.run(coro)


async def post(srv, body, headers=None):
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.url + "/mixdesk/grid", json=body, headers=headers) as r:
            return r.status, await r.json()


GRID_BODY = {
    "messages": MESSAGES,
    "n_predict": N,
    "temperature": 0,
    "ignore_eos": True,
    "x": {"kind": "scale", "adapter": 0, "values": [0, 0.5, 1]},
    "y": {"kind": "scale", "adapter": "lora_ffn", "values": [0, 1]},
}


def test_http_grid_returns_every_cell_as_the_core_runs_it(server, ran):
    _, _, results, _ = ran
    st, out = run_async(post(server, GRID_BODY))
    assert st == 200, out
    assert out["columns"] == 3 and out["rows"] == 2 and len(out["cells"]) == 6
    assert out["x"]["labels"] == ["lora_attn ×0", "lora_attn ×0.5", "lora_attn ×1"]
    for cell, r in zip(out["cells"], results):
        assert cell["cell"] == r.cell.index
        assert {e["id"]: e["scale"] for e in cell["lora"]} == r.cell.mix
        assert cell["content"] == r.text and cell["tokens_predicted"] == N
        assert cell["stop_type"] == "limit" and cell["predicted_per_second"] > 0


def test_http_grid_presets_and_raw_prompt(server, eng):
    body = {
        "prompt": "The sky is",
        "n_predict": 3,
        "temperature": 0,
        "ignore_eos": True,
        "presets": {"attn": [{"id": 0, "scale": 1}], "both": [{"id": 0}, {"id": 1}]},
        "x": {"kind": "preset", "values": ["attn", "both"]},
    }
    st, out = run_async(post(server, body))
    assert st == 200, out
    assert [c["mix"] for c in out["cells"]] == [
        "lora_attn ×1.00",
        "lora_attn ×1.00, lora_ffn ×1.00",
    ]
    tokens = eng.tokenizer.encode("The sky is", add_special=True, parse_special=True)
    assert out["prompt_n"] == len(tokens)
    alone = eng.complete(tokens, greedy(3), mix={0: 1.0, 1: 1.0})
    assert out["cells"][1]["content"] == alone.content


@pytest.mark.parametrize(
    "change, message",
    [
        ({"x": {"kind": "scale", "adapter": 0, "values": []}}, "x has no values"),
        ({"x": {"kind": "scale", "adapter": 9, "values": [1]}}, "no adapter with id 9"),
        ({"x": {"kind": "scale", "adapter": "zz", "values": [1]}}, "no adapter named 'zz'"),
        ({"x": {"kind": "scale", "adapter": 0, "values": [1e300]}}, "finite number"),
        ({"x": {"kind": "scale", "adapter": 0, "values": ["a"]}}, "finite number"),
        ({"x": {"kind": "preset", "values": ["nope"]}}, "unknown preset 'nope'"),
        ({"x": {"kind": "colour", "values": [1]}}, "x.kind must be one of"),
        ({"y": {"kind": "seed", "values": list(range(30))}}, "too large"),
        ({"x": None}, "x must be an object"),
        ({"prompt": "both"}, 'either "messages"'),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_http_bad_grids_are_400_with_a_message(server, change, message):
    body = {**GRID_BODY, **change}
    st, out = run_async(post(server, body))
    assert st == 400, out
    assert out["error"]["type"] == "invalid_request_error"
    assert message in out["error"]["message"]


def test_grid_mix_lists_take_ids_or_names_and_refuse_as_grid_errors(names):
    """A grid's base mix and presets are read as a request's "lora" list (one reader,
    core/lora/registry.scales_of_list), with adapters also named by name; each fault
    is a GridError naming the field."""
    body = {**GRID_BODY, "lora": [{"id": "lora_ffn", "scale": 0.5}],
            "presets": {"p": [{"id": 0}]}}  # fmt: skip
    spec = G.parse_spec(body, greedy(), names)
    assert spec.base == {0: 0.0, 1: 0.5} and spec.presets == {"p": {0: 1.0, 1: 0.0}}
    for change, message in (
        ({"lora": {"id": 0}}, 'lora must be a list of {"id", "scale"} objects'),
        ({"lora": [7]}, 'each lora entry must be an object with "id" and "scale"'),
        ({"lora": [{"id": "zz"}]}, "lora: id: no adapter named 'zz'"),
        ({"presets": {"p": [{"id": 0, "scale": 1e20}]}}, "presets['p']: scale of adapter 0"),
    ):
        with pytest.raises(G.GridError, match=re.escape(message)):
            G.parse_spec({**GRID_BODY, **change}, greedy(), names)


def test_http_grid_needs_the_api_key(eng):
    srv = ServerThread(eng, ServerSettings(port=0, api_keys=["sekrit"])).start()
    try:
        body = {**GRID_BODY, "n_predict": 1, "y": None}
        st, out = run_async(post(srv, body))
        assert st == 401 and out["error"]["type"] == "authentication_error"
        st, out = run_async(post(srv, body, {"Authorization": "Bearer sekrit"}))
        assert st == 200 and len(out["cells"]) == 3
    finally:
        srv.stop()


def test_http_grid_streams_events_with_cell_indices(server, ran):
    _, _, results, _ = ran

    async def go():
        events = []
        async with aiohttp.ClientSession() as s:
            async with s.post(
                server.url + "/mixdesk/grid", json={**GRID_BODY, "stream": True}
            ) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                async for line in r.content:
                    line = line.decode().strip()
                    if line:
                        assert line.startswith("data: ")
                        events.append(line[6:])
        return events

    events = run_async(go())
    assert events[-1] == "[DONE]"
    body = [json.loads(e) for e in events[:-1]]
    assert body[0]["grid"]["columns"] == 3 and body[0]["grid"]["rows"] == 2
    text = {i: "" for i in range(6)}
    done = {}
    for ev in body[1:]:
        i = ev["cell"]
        assert i not in done  # no content after a cell's done
        if ev.get("done"):
            done[i] = ev
        else:
            text[i] += ev["content"]
    assert sorted(done) == list(range(6))
    for r in results:
        assert text[r.cell.index] == done[r.cell.index]["content"] == r.text


def test_http_grid_client_disconnect_cancels_every_cell(server, eng):
    finished: list[RequestFinished] = []
    all_done = threading.Event()

    def listen(ev):
        if isinstance(ev, RequestFinished) and ev.source == "http":
            finished.append(ev)
            if len(finished) == 4:
                all_done.set()

    unsubscribe = eng.subscribe(listen)
    body = {
        "messages": MESSAGES,
        "n_predict": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "x": {"kind": "seed", "values": [1, 2, 3, 4]},
    }

    async def go():
        async with aiohttp.ClientSession() as s:
            r = await s.post(server.url + "/mixdesk/grid", json=body)
            assert r.status == 200
            await r.content.readline()  # the grid header
            await r.content.readline()
            await r.content.readline()  # a first token
            r.close()  # hang up mid-grid

    try:
        run_async(go())
        assert all_done.wait(60), finished
    finally:
        unsubscribe()
    assert [f.stop_type for f in finished] == ["cancel"] * 4
    assert all(f.predicted_n < 200 for f in finished)


# ---- the merge method as an axis -------------------------------------------------------------


def test_method_axis_cells_carry_their_merge_spec(names):
    from core.lora.merge import MergeSpec

    body = {
        "prompt": "x",
        "x": {"kind": "method", "values": ["linear", {"method": "ties", "density": 0.3}]},
        "y": {"kind": "scale", "adapter": 1, "values": [0.5, 1]},
    }
    spec = G.parse_spec(body, greedy(), names)
    cells = G.cells(spec, {0: 1.0, 1: 0.0}, names)
    assert [c.mix.merge for c in cells] == [
        MergeSpec.make("linear"),
        MergeSpec.make("ties", density=0.3),
    ] * 2
    assert [dict(c.mix) for c in cells[2:]] == [{0: 1.0, 1: 1.0}] * 2
    assert cells[1].x_label == "ties d=0.3"
    assert mix_text(cells[1].mix, names) == "lora_attn ×1.00, lora_ffn ×0.50 (ties d=0.3)"
    for bad, message in (
        (["mean"], "merge method must be one of"),
        ([{"method": "ties", "density": 2}], "density must be a number in (0, 1]"),
        ([{"method": "ties", "colour": 1}], "unknown field"),
    ):
        with pytest.raises(G.GridError, match=message.replace("(", r"\(").replace("]", r"\]")):
            G.parse_spec({**body, "x": {"kind": "method", "values": bad}}, greedy(), names)


def test_method_axis_runs_each_cell_merged_as_that_mix_alone(eng):
    from core.lora.mix import MergedKey

    spec = G.GridSpec(
        G.Axis("method", ("linear", "ties")),
        None,
        greedy(4),
        messages=MESSAGES,
        base={0: 1.0, 1: 1.0},
    )
    run, results = G.run_grid(eng, spec, timeout=600)
    linear, ties = run.requests
    assert not isinstance(linear.mix, MergedKey) and linear.mix == ((0, 1.0), (1, 1.0))
    assert isinstance(ties.mix, MergedKey) and ties.mix.merge.method == "ties"
    alone = eng.complete(G.encode(eng, spec), results[1].cell.params, mix=results[1].cell.mix)
    assert alone.mix == ties.mix and alone.content == results[1].text


def test_http_method_axis_reports_each_cells_merge(server):
    body = {
        **GRID_BODY,
        "n_predict": 2,
        "lora": [{"id": 0, "scale": 1}, {"id": 1, "scale": 1}],
        # cat stacks the ranks (nothing to build): cheap, and a method of its own
        "x": {"kind": "method", "values": ["linear", {"method": "cat"}]},
        "y": None,
    }
    st, out = run_async(post(server, body))
    assert st == 200, out
    assert [c["merge"] for c in out["cells"]] == [{"method": "linear"}, {"method": "cat"}]
    assert out["x"]["values"] == [{"method": "linear"}, {"method": "cat"}]
    assert out["x"]["labels"] == ["linear", "cat"]
    assert out["cells"][1]["mix"] == "lora_attn ×1.00, lora_ffn ×1.00 (cat)"
    # the same reply: cat is the weighted sum with the ranks stacked
    assert out["cells"][0]["content"] == out["cells"][1]["content"]
