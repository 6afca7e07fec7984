"""The Gradio app, driven over HTTP with gradio_client against a real server in a subprocess.

Covers every named endpoint (/run, /attention, /residual, /save_trace, /preset, /compare,
/compare_all, /generate, /load_model, /pick_model), streaming, switching to the bundled Gemma and
back, server-side limits and bad inputs (each must give a readable message and leave the server
working). Numbers the app shows are checked against the library run in this process; the model
store's locking and the load queue are checked in-process. Does not cover the page itself
(tests/test_browser.py does) nor loading a model from the hub (no network here).
"""

from __future__ import annotations

import json
import threading

import pytest
from app_helpers import REPO  # also puts the repo root on sys.path for `app`
from gradio_client import Client
from gradio_client.exceptions import AppError

import slmviz
from app.models import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS
from app.variant_fields import FAITHFUL_WIDGETS, VARIANT_FIELDS, widget_value
from slmviz.variants import PRESETS

pytestmark = pytest.mark.app

PROMPT = "The cat sat on the mat. The cat sat on the"
STAGES = ["pre", "mid", "post"]
GEMMA = "gemma-3-270m"


def preset_fields(name: str) -> list:
    """A preset's Variant as the Break-it widgets send it (one value per Variant field, in field order)."""
    return [widget_value(f, getattr(PRESETS[name].variant, f)) for f in VARIANT_FIELDS]


def fields_with(**changes) -> list:
    return [changes.get(f, w) for f, w in zip(VARIANT_FIELDS, FAITHFUL_WIDGETS, strict=True)]


FAITHFUL_FIELDS = FAITHFUL_WIDGETS
ROPE_FIELDS = preset_fields("rope_interleaved")


@pytest.fixture()
def client(server):
    """A fresh session (its own gr.State) per test."""
    return Client(server, verbose=False)


def run(client: Client, prompt: str = PROMPT, layer: int = 1, head: str = "all") -> tuple:
    return client.predict(prompt, False, layer, head, STAGES, False, False, True, api_name="/run")


def figure(plot: dict) -> dict:
    assert plot["type"] == "plotly"
    return json.loads(plot["plot"])


def test_every_handler_is_a_named_endpoint(client):
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/run", "/logit_lens", "/attention", "/residual", "/save_trace", "/preset", "/compare", "/compare_all",
            "/generate", "/load_model", "/pick_model"} <= names


def test_run_shows_tokens_plots_and_the_models_next_token(client, model):
    tokens, attention, residual, table, status, *_ = run(client)
    expected = model.trace(PROMPT)
    assert tokens.count("title=\"position") == len(expected.tokens)
    att = figure(attention)
    assert "all 9 heads" in att["layout"]["title"]["text"]
    assert att["config"]["toImageButtonOptions"]["format"] == "png"  # modebar PNG download stays on
    assert "Residual stream" in figure(residual)["layout"]["title"]["text"]
    lens = figure(client.predict(api_name="/logit_lens"))  # the page chains it after /run
    assert "Logit lens" in lens["layout"]["title"]["text"]
    assert table["headers"] == ["rank", "token", "token_id", "prob"]
    assert [row[2] for row in table["data"]] == expected.top_tokens(k=10)["token_id"].tolist()
    assert f"{len(expected.tokens)} tokens" in status


def test_layer_head_and_residual_options_replot_the_last_run(client):
    run(client)
    single = figure(client.predict(3, "4", api_name="/attention"))
    assert single["layout"]["title"]["text"].startswith("Attention, layer 3, head 4")
    residual = figure(client.predict(["post"], True, True, False, api_name="/residual"))
    assert residual["layout"]["yaxis"]["type"] == "log"
    assert "first token hidden" in residual["layout"]["title"]["text"].replace("<br>", " ")  # wrapped to fit


def test_saved_trace_downloads_and_loads_back(client, tmp_path):
    run(client)
    path = client.predict(api_name="/save_trace")
    t = slmviz.Trace.load(path)
    assert "".join(t.tokens) == PROMPT and "blocks.0.attn.hook_pattern" in t.names


def test_example_prompts_come_from_the_assets_file(client):
    examples = json.loads((REPO / "app" / "examples.json").read_text(encoding="utf-8"))
    for i in (0, len(examples) - 1):
        assert client.predict(i, api_name="/example") == (examples[i]["prompt"], examples[i]["chat"])


def test_presets_fill_the_variant_fields(client):
    *values, description = client.predict("post_norm", api_name="/preset")
    assert values == preset_fields("post_norm") and values[VARIANT_FIELDS.index("norm")] == "post"
    assert PRESETS["post_norm"].description in description


def test_compare_puts_faithful_and_variant_side_by_side(client, model):
    out = client.predict(PROMPT, False, *ROPE_FIELDS, 2, "0", 8, api_name="/compare")
    verdict, next_faithful, next_broken, kl, overlay, diff, att_f, att_b, cont_f, cont_b = out
    assert PRESETS["rope_interleaved"].description in verdict
    broken = model.trace(PROMPT, variant="rope_interleaved")
    assert [r[2] for r in next_broken["data"]] == broken.top_tokens(k=10)["token_id"].tolist()
    assert "rope_interleaved" in figure(kl)["layout"]["title"]["text"]
    assert len(figure(overlay)["data"]) == 6
    assert figure(diff)["data"][0]["type"] == "heatmap"
    assert "faithful" in figure(att_f)["layout"]["title"]["text"]
    assert "rope_interleaved" in figure(att_b)["layout"]["title"]["text"]
    assert cont_f == model.generate(PROMPT, 8)
    assert cont_b == model.generate(PROMPT, 8, variant="rope_interleaved")


def test_compare_of_an_overflowing_variant_explains_instead_of_failing(client):
    verdict, _, next_broken, kl, *_ = client.predict(PROMPT, False, *fields_with(norm="none"), 1, "0", 4,
                                                     api_name="/compare")
    assert "stopped being finite" in verdict
    assert "not finite" in next_broken["data"][0][1]
    assert any("stopped being finite" in a["text"] for a in figure(kl)["layout"]["annotations"])


def test_compare_every_preset_reports_one_row_per_variant_that_applies(client, model):
    table = client.predict("The capital of France is", False, api_name="/compare_all")
    assert [row[0] for row in table["data"]] == [n for n in slmviz.variants(model) if n != "faithful"]
    assert "no_norm_offset" not in [row[0] for row in table["data"]]  # Gemma's: not offered on SmolLM2
    assert "kl_mean" in table["headers"]


def test_generate_streams_both_continuations_token_by_token(client, model):
    job = client.submit(PROMPT, False, *ROPE_FIELDS, 10, 0, 0, 0, api_name="/generate")
    updates = list(job)
    assert len(updates) > 2  # streamed, not returned at once
    faithful, broken = updates[-1]
    assert faithful == model.generate(PROMPT, 10)
    assert broken == model.generate(PROMPT, 10, variant="rope_interleaved")
    assert all(len(a[0]) <= len(b[0]) for a, b in zip(updates, updates[1:], strict=False))


def test_sampling_with_a_seed_is_repeatable(client):
    args = (PROMPT, False, *FAITHFUL_FIELDS, 6, 0.8, 20, 1234)
    first = client.predict(*args, api_name="/generate")
    assert client.predict(*args, api_name="/generate") == first


BAD_INPUTS = {
    "empty prompt": ("/run", ("", False, 1, "all", STAGES, False, False, True), "empty"),
    "blank prompt": ("/run", ("   \n", False, 1, "all", STAGES, False, False, True), "empty"),
    "prompt over the token limit": (
        "/run", ("word " * (MAX_PROMPT_TOKENS + 50), False, 1, "all", STAGES, False, False, True),
        f"limit is {MAX_PROMPT_TOKENS}"),
    "huge prompt": ("/run", ("x" * 100_000, False, 1, "all", STAGES, False, False, True), "limit"),
    "layer out of range": ("/run", (PROMPT, False, 99, "all", STAGES, False, False, True), "29"),
    "unknown head": ("/run", (PROMPT, False, 1, "seven", STAGES, False, False, True), "seven"),
    "no residual stage": ("/run", (PROMPT, False, 1, "all", [], False, False, True), "stage"),
    "unknown norm placement": ("/compare", (PROMPT, False, *fields_with(norm="sideways"), 1, "0", 4), "sideways"),
    "rope base below 1": (
        "/compare", (PROMPT, False, *fields_with(rope_theta=0.5), 1, "0", 4), "RoPE base must be a number above 1"),
    "a Gemma-only field on SmolLM2": (
        "/compare", (PROMPT, False, *fields_with(norm_offset=False), 1, "0", 4), "norm_offset=False needs"),
    "too many new tokens": (
        "/generate", (PROMPT, False, *FAITHFUL_FIELDS, MAX_NEW_TOKENS + 1, 0, 0, 0), str(MAX_NEW_TOKENS)),
    "negative temperature": ("/generate", (PROMPT, False, *FAITHFUL_FIELDS, 4, -1, 0, 0), "-1"),
    "unknown preset": ("/preset", ("rope_sideways",), "rope_sideways"),
    # the preset dropdown lists only this model's presets, the picker only the bundled models: Gradio refuses others
    "a preset of another family": ("/preset", ("no_norm_offset",), "not in the list of choices: ['faithful'"),
    "not a bundled model": ("/pick_model", ("gemma-3-27b",), "not in the list of choices"),
    "local folder without the flag": ("/load_model", ("./some/folder",), "--allow-local-models"),
    "not a hub id": ("/load_model", ("not a hub id!",), "owner/name"),
    "replot before any run": ("/attention", (1, "all"), "Run a prompt first"),
    "logit lens before any run": ("/logit_lens", (), "Run a prompt first"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_a_readable_message_and_the_next_request_works(client, case):
    endpoint, args, fragment = BAD_INPUTS[case]
    with pytest.raises(AppError) as err:
        client.predict(*args, api_name=endpoint)
    message = str(err.value)
    assert fragment in message and "Traceback" not in message
    assert run(client, "Hello")[0].count('title="position') == 1


def test_loading_the_startup_model_again_keeps_the_session_working(client):
    status, *_ = client.predict("", api_name="/load_model")
    assert "SmolLM2-135M-Instruct" in status
    assert run(client)[4].startswith("Traced")


@pytest.mark.slow
def test_the_model_picker_switches_this_session_to_gemma_and_back(server):
    """Gemma: its 4 query heads in one KV row, sliding/global layer labels, only the presets that apply.
    Another session meanwhile stays on SmolLM2. (Gemma is prepared by `make model`; here it is only loaded.)"""
    gemma, other = Client(server, verbose=False), Client(server, verbose=False)
    status, *_ = gemma.predict(GEMMA, api_name="/pick_model")
    assert "**gemma-3-270m**" in status and "gemma3_text" in status and "1 KV heads" in status
    tokens, attention, residual, table, ran = run(gemma, "The capital of France is", layer=5)
    assert "gemma-3-270m" in ran and tokens.count('title="position') == 6  # <bos> + 5 tokens
    att = figure(attention)
    assert att["layout"]["title"]["text"].startswith("Attention, layer 5 (global), all 4 heads")
    assert "MQA" in att["layout"]["title"]["subtitle"]["text"]
    assert "5 G" in figure(residual)["layout"]["xaxis"]["ticktext"]
    assert [row[1] for row in table["data"]][:1] == ["␣the"]
    *values, description = gemma.predict("no_norm_offset", api_name="/preset")
    assert values[VARIANT_FIELDS.index("norm_offset")] is False and "(1 + w)" in description
    compare_table = gemma.predict("The capital of France is", False, api_name="/compare_all")
    offered = [row[0] for row in compare_table["data"]]
    assert {"no_norm_offset", "no_embed_scale", "no_sliding_window"} <= set(offered) and "gqa_tile" not in offered
    assert "SmolLM2" in run(other)[4]  # the other session never switched
    status, *_ = gemma.predict("SmolLM2-135M-Instruct", api_name="/pick_model")
    assert "**SmolLM2-135M-Instruct**" in status and "SmolLM2" in run(gemma)[4]


@pytest.mark.slow
def test_with_both_bundled_models_loaded_the_server_stays_bounded(server, record_property):
    """Peak RSS of the server while one session runs and compares on SmolLM2 and another on Gemma (README's
    limits section quotes it). Another session's Run while Gemma loads must not wait for the load."""
    from test_app_load import MAX_SERVER_RSS, PeakRss, server_process

    smol, gemma = Client(server, verbose=False), Client(server, verbose=False)
    proc = server_process(server)
    with PeakRss(proc) as rss:
        run(smol)
        job = gemma.submit(GEMMA, api_name="/pick_model")
        assert run(smol)[4].startswith("Traced")
        assert "gemma3_text" in job.result()[0]
        for client in (smol, gemma):
            run(client)
            client.predict(PROMPT, False, *FAITHFUL_FIELDS, 1, "0", 8, api_name="/compare")
    print(f"\nserver peak RSS with SmolLM2 and Gemma loaded: {rss.peak / 2**20:.0f} MiB")
    record_property("server_peak_rss_two_models_mib", round(rss.peak / 2**20))
    assert rss.peak < MAX_SERVER_RSS


def test_widget_values_round_trip_to_variants_and_a_wrong_count_says_what_is_expected():
    from app.variant_fields import field_value, split_inputs, variant_from_fields

    for name in PRESETS:
        assert variant_from_fields(preset_fields(name)) == PRESETS[name].variant
    assert [field_value(f, w) for f, w in zip(VARIANT_FIELDS, FAITHFUL_FIELDS, strict=True)] == [
        getattr(PRESETS["faithful"].variant, f) for f in VARIANT_FIELDS]
    with pytest.raises(ValueError, match=f"Expected {2 + len(VARIANT_FIELDS) + 4} inputs"):
        split_inputs((PROMPT, False, "pre", "rms", "rotate_half", None, "grouped", True, "swiglu", False, 1, "0", 4),
                     2, 4)


def test_model_loads_queue_apart_from_model_work_with_progress():
    """The load events use their own queue ("load"): a minute-long first Gemma load never takes the single
    "model" slot that every Run waits for; nor do the calls that decode for seconds ("decode")."""
    from app import main
    from app.models import AppContext, ModelStore

    demo = main.build(AppContext(ModelStore()))
    ids = {fn.api_name: fn.concurrency_id for fn in demo.fns.values()}
    assert ids["load_model"] == ids["pick_model"] == "load"
    assert ids["run"] == ids["feature_prompt"] == "model"
    assert ids["compare"] == ids["compare_all"] == ids["generate"] == ids["steer"] == "decode"


def test_a_slow_load_holds_up_neither_loaded_models_nor_a_second_request_for_it(monkeypatch):
    """ModelStore locks per model while loading: the startup model stays served, and two sessions asking for
    the model being loaded share one load."""
    from app.models import ModelStore

    store = ModelStore()
    startup = store.get()
    release, loads = threading.Event(), []

    def slow_load(key, dtype="float32"):
        loads.append(key)
        assert release.wait(30)
        return startup

    monkeypatch.setattr(store, "_load", slow_load)
    waiting = [threading.Thread(target=store.get, args=(GEMMA,)) for _ in range(2)]
    for t in waiting:
        t.start()
    assert store.get() is startup and not store.is_loaded(GEMMA)  # answered while Gemma is "loading"
    release.set()
    for t in waiting:
        t.join(30)
    assert loads == [GEMMA] and store.is_loaded(GEMMA)


def test_preparing_a_bundled_model_reports_each_step_as_progress(monkeypatch):
    from app.tabs import model as model_tab

    calls = []
    steps = ("assembling", "dequantizing", "saving", "ready at /x")
    monkeypatch.setattr(model_tab, "prepare_bundled", lambda name, log: [log(s) for s in steps])
    model_tab.ModelHandlers.prepare(GEMMA, lambda fraction, desc: calls.append((fraction, desc)))
    assert [d for _, d in calls] == ["Preparing gemma-3-270m once (dequantizing its GGUF, about a minute)",
                                     "gemma-3-270m: assembling", "gemma-3-270m: dequantizing", "gemma-3-270m: saving",
                                     "gemma-3-270m: ready at /x"]
    assert [f for f, _ in calls] == sorted(f for f, _ in calls)


def test_local_model_folders_load_only_with_the_flag(tiny_dir):
    """The flag lets /load_model (and --model) read a local folder; without it the store refuses."""
    from app.models import ModelStore

    with pytest.raises(ValueError, match="--allow-local-models"):
        ModelStore(allow_local=False).key(str(tiny_dir))
    store = ModelStore(allow_local=True, max_prompt_tokens=MAX_PROMPT_TOKENS)
    model = store.get(str(tiny_dir))
    assert model.cfg.n_layers == 2 and model.max_tokens <= MAX_PROMPT_TOKENS
    assert store.get(str(tiny_dir)) is model  # loaded once, then shared


def test_hub_ids_are_validated_before_any_download():
    from app.models import ModelStore

    store = ModelStore()
    assert store.key("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for bad in ("owner/..", "no-slash", "a/b/c", "https://example.com/x", "/etc/passwd"):
        with pytest.raises(ValueError):
            store.key(bad)


@pytest.mark.parametrize("path", ["pyproject.toml", "slmviz/trace.py", "app/main.py", "/etc/passwd"])
def test_the_server_serves_no_file_outside_its_outputs(server, path):
    import urllib.error
    import urllib.request

    target = path if path.startswith("/") else str(REPO / path)
    for url in (f"{server}/gradio_api/file={target}", f"{server}/file={target}", f"{server}/gradio_api/file={path}"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=10)
        assert err.value.code in (403, 404)


def test_launch_takes_the_port_from_the_argument_or_the_environment_and_loads_nothing_remote(monkeypatch):
    """Builds the real page in-process; only gr.Blocks.launch (the HTTP server) is replaced by a recorder."""
    import gradio as gr

    from app import main

    calls = []
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kw: calls.append(kw))
    monkeypatch.setenv("GRADIO_SERVER_PORT", "7999")
    main.launch()
    main.launch(port=7123, host="0.0.0.0")
    assert [(c["server_name"], c["server_port"]) for c in calls] == [("127.0.0.1", 7999), ("0.0.0.0", 7123)]
    fonts = [*calls[0]["theme"].font, *calls[0]["theme"].font_mono]
    assert not any(isinstance(f, gr.themes.GoogleFont) for f in fonts)  # no fonts.googleapis.com
    monkeypatch.delenv("GRADIO_SERVER_PORT")
    main.launch()
    assert calls[-1]["server_port"] == main.DEFAULT_PORT == 7860


def test_on_a_space_without_the_hub_the_app_falls_back_to_the_bundled_model(monkeypatch):
    import huggingface_hub.constants

    from app.models import ModelStore

    monkeypatch.setenv("SPACE_ID", "someone/slmviz")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # this machine has no hub access
    store = ModelStore()
    model = store.get()
    assert model.cfg.n_layers == 30
    assert "SmolLM2-135M-Instruct" in model.name
    assert model.name == "HuggingFaceTB/SmolLM2-135M-Instruct" or "bundled copy" in store.startup_note
