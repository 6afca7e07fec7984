"""The Circuits tab over HTTP (gradio_client against real servers): scoring, the faithfulness curve, the top-n slider,
exact edge patches, the task generators, cancelling, and readable errors.

Where the real model is not the point, the server runs a tiny random llama (82 edges), so `exact` runs in a blink
and its numbers are checked against the library run in this process, and against identities the library does not
compute the same way: an edge patched alone moves the metric by its exact score; the top-n circuit is the
faithfulness curve's point at n; the circuit without an edge equals `patch_edges` over the named complement.
The bundled SmolLM2 server covers the IOI and greater-than generators, the size limit of `exact`, and a long
EAP-IG job that another session's Run overtakes (checked by order of completion, never by time).

Does not cover: the page itself (tests/test_circuits_browser.py clicks through it), nor the attribution graph's
numbers (tests of slmviz.graphs.attribution).
"""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from app_helpers import app_server
from conftest import build_tiny_model
from gradio_client import Client
from gradio_client.exceptions import AppError

import slmviz
from app.tabs.circuits import EXACT_MAX_EDGES, REFINE_SIZES, TASK_CHOICES
from app.tabs.graph_attribution import feature_table
from slmviz import SAE
from slmviz.circuits.tasks import induction_task
from slmviz.features.load import load_sae
from slmviz.model_api import load_folder

pytestmark = pytest.mark.app

CLEAN, CORRUPTED, ANSWER, WRONG = "w5 w6 w7 w8 w9", "w5 w6 w3 w8 w9", " w2", " w4"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("circuits-app") / "tiny", "llama_gqa", seed=3)


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_folder(tiny_folder)


@pytest.fixture(scope="module")
def transcoders(tiny_folder, tiny):
    """Random transcoders of the tiny model's layers 0 and 1, offered to the app through $SLMVIZ_SAE_DIRS."""
    root = tiny_folder.parent / "transcoders"
    d = tiny.cfg.d_model
    for layer in (0, 1):
        SAE.random(d, d, seed=layer, architecture="relu", hook_name=f"blocks.{layer}.mlp.hook_in",
                   hook_name_out=f"blocks.{layer}.hook_mlp_out").save(root / f"tc_l{layer}")
    return root


@pytest.fixture(scope="module")
def tiny_server(tiny_folder, transcoders):
    with app_server(env={"SLMVIZ_SAE_DIRS": str(transcoders)}, model=str(tiny_folder),
                    allow_local_models=True) as url:
        yield url


@pytest.fixture(scope="module")
def smol_server(server):
    return server  # the default app, shared (conftest)


def figure(plot: dict) -> dict:
    assert plot["type"] == "plotly"
    return json.loads(plot["plot"])


def array(value) -> np.ndarray:
    if isinstance(value, dict) and "bdata" in value:
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
    return np.asarray(value, dtype=float)


def run(client, method="exact", top=10, clean=CLEAN, corrupted=CORRUPTED, answer=ANSWER, wrong=WRONG, steps=5):
    """graph, faithfulness, status, edge table, answer, wrong (the State output is not sent to clients)."""
    return client.predict(clean, corrupted, answer, wrong, method, steps, top, api_name="/circuit_run")


def test_the_circuit_endpoints_are_named(tiny_server):
    names = set(Client(tiny_server, verbose=False).view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/circuit_run", "/circuit_task", "/circuit_edge", "/circuit_top", "/circuit_cancel",
            "/circuit_attribution", "/circuit_prune", "/circuit_feature"} <= names


def test_an_exact_run_draws_the_library_scores_and_faithfulness(tiny_server, tiny):
    graph, curve, status, table, answer, wrong = run(Client(tiny_server, verbose=False), top=10)
    c = slmviz.circuit(CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, model=tiny, method="exact")
    top = c.top(10)
    assert [row[1:3] for row in table["data"]] == top[["source", "target"]].values.tolist()
    np.testing.assert_allclose([row[3] for row in table["data"]], top["score"], atol=1e-4)
    # the graph: one line per top edge, width growing with |score|, colour by sign, then the nodes
    lines = [t for t in figure(graph)["data"] if t["mode"] == "lines"]
    assert len(lines) == 10
    widths = [t["line"]["width"] for t in lines]
    assert widths == sorted(widths, reverse=True)
    assert {t["line"]["color"] for t, s in zip(lines, top["score"], strict=True) if s < 0} <= {"#c0392b"}
    # the curve: the library's faithfulness at the default sizes; the smallest 80 % circuit as the library finds it
    expected = c.faithfulness()
    (points,) = figure(curve)["data"]
    np.testing.assert_allclose(array(points["y"]), expected["normalized"], atol=1e-4)
    assert expected["normalized"].iloc[0] == pytest.approx(0, abs=1e-5)  # no edge clean: the corrupted run
    assert expected["normalized"].iloc[-1] == pytest.approx(1, abs=1e-5)  # every edge: the clean run
    smallest = c.smallest(0.8, count=REFINE_SIZES, curve=expected)
    assert f"has **{smallest:,}** of {c.graph.n_edges:,} edges" in status
    assert f"{c.clean:.3f} on the clean prompt and {c.corrupted:.3f}" in status
    assert (answer, wrong) == (ANSWER, WRONG)


def test_an_edge_patch_alone_and_as_the_circuit_without_it(tiny_server, tiny):
    client = Client(tiny_server, verbose=False)
    *_, table, _, _ = run(client, top=10)
    edge = f"{table['data'][0][1]}->{table['data'][0][2]}"
    text, result = client.predict(edge, 10, api_name="/circuit_edge")
    alone, circuit, without = (row[2] for row in result["data"])
    c = slmviz.circuit(CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, model=tiny, method="exact")
    # exact's score is the metric with that edge alone patched, minus the clean metric
    assert alone == pytest.approx(c.clean + c.score(edge), abs=2e-4)
    assert circuit == pytest.approx(float(c.faithfulness([10])["metric"][0]), abs=2e-4)
    kept = set(map(tuple, c.top(10)[["source", "target"]].values.tolist())) - {tuple(edge.split("->"))}
    complement = [e for e in slmviz.graph_edges(tiny) if e not in kept]
    assert without == pytest.approx(slmviz.patch_edges(CLEAN, CORRUPTED, edges=complement, answer=ANSWER,
                                                       wrong=WRONG, model=tiny), abs=2e-4)
    assert edge in text and "without this edge" in text
    # an edge outside the top n: the circuit with and without it is the same circuit
    last = f"{c.edges['source'].iloc[-1]}->{c.edges['target'].iloc[-1]}"
    text, result = client.predict(last, 10, api_name="/circuit_edge")
    assert result["data"][1][2] == result["data"][2][2] and "not in the top 10" in text


def test_the_slider_redraws_without_running(tiny_server, tiny):
    client = Client(tiny_server, verbose=False)
    run(client, method="eap", top=10)
    graph, curve, table = client.predict(3, api_name="/circuit_top")
    assert len(table["data"]) == 3
    assert len([t for t in figure(graph)["data"] if t["mode"] == "lines"]) == 3
    assert any("top 3" in a.get("text", "") for a in figure(curve)["layout"]["annotations"])
    _, _, table = client.predict(300, api_name="/circuit_top")  # more than the tiny graph has: all of them
    assert len(table["data"]) == len(slmviz.graph_edges(tiny))


def test_a_task_pair_runs_on_the_tasks_own_token_ids(tiny_server, tiny):
    client = Client(tiny_server, verbose=False)
    clean, corrupted, answer, wrong, note = client.predict("induction", 2, api_name="/circuit_task")
    assert "induction, pair 2" in note
    *_, status, table, _, _ = client.predict(clean, corrupted, answer, wrong, "eap", 5, 5, api_name="/circuit_run")
    c = slmviz.circuit(induction_task(tiny, n=1, seed=2), model=tiny, method="eap")
    assert [row[1:3] for row in table["data"]] == c.top(5)[["source", "target"]].values.tolist()
    assert f"{c.clean:.3f} on the clean prompt" in status


def test_bad_input_is_a_readable_error_and_the_state_is_kept(tiny_server):
    client = Client(tiny_server, verbose=False)
    with pytest.raises(AppError, match="Run the circuit first"):
        client.predict("m0->logits", 10, api_name="/circuit_edge")
    run(client, method="eap", top=10)
    with pytest.raises(AppError, match=r"same number of tokens.*\['w5', 'w6', 'w7', 'w8', 'w9'\].*\['w5', 'w6'\]"):
        run(client, corrupted="w5 w6")
    with pytest.raises(AppError, match="is 2 tokens"):
        run(client, answer=" w2 w3")
    with pytest.raises(AppError, match="less than minimum value 1"):
        run(client, method="eap-ig", steps=0)
    with pytest.raises(AppError, match="'a1.h9' is not a source node.*did you mean"):
        client.predict("a1.h9->logits", 10, api_name="/circuit_edge")
    with pytest.raises(AppError, match="There is no edge m1 -> a0.h0<q>"):
        client.predict("m1->a0.h0<q>", 10, api_name="/circuit_edge")
    with pytest.raises(AppError, match="IOI needs 3 names"):
        client.predict("ioi", 0, api_name="/circuit_task")
    text, _ = client.predict("m0->logits", 10, api_name="/circuit_edge")  # the last good run is still there
    assert "m0->logits" in text


ATTR_PROMPT = "w3 w5 w7 w9"


def test_the_attribution_graph_is_the_librarys_and_a_feature_opens_its_page(tiny_server, tiny, transcoders):
    client = Client(tiny_server, verbose=False)
    names = ["tc_l0", "tc_l1"]
    plot, table, path, status = client.predict(ATTR_PROMPT, names, 0.95, 0.98, api_name="/circuit_attribution")
    tcs = [load_sae(transcoders / name, model=tiny) for name in names]
    pruned = slmviz.attribution_graph(ATTR_PROMPT, transcoders=tcs, model=tiny).prune(0.95, 0.98)
    expected = feature_table(pruned, {0: "tc_l0", 1: "tc_l1"})
    assert [row[:3] for row in table["data"]] == expected[["layer", "feature", "position"]].values.tolist()
    assert {row[5] for row in table["data"]} <= set(names)
    saved = json.loads(Path(path).read_text(encoding="utf-8"))  # circuit-tracer's graph JSON of the pruned graph
    assert {n["node_id"] for n in saved["nodes"]} == {n["node_id"] for n in pruned.to_json()["nodes"]}
    assert len(saved["links"]) == len(pruned.to_json()["links"])
    assert figure(plot)["data"] and f"{pruned.n_features} active features" in status
    # the slider prunes again without running the model: fewer features at a lower threshold
    _, fewer, _, _ = client.predict(0.6, 0.98, api_name="/circuit_prune")
    assert len(fewer["data"]) < len(table["data"])
    # a feature node opens its page (the Features tab's card)
    layer, feature, position = table["data"][0][:3]
    card, node = client.predict(f"{layer}_{feature}_{position}", api_name="/circuit_feature")
    assert node == f"{layer}_{feature}" and f"tc_l{layer}" in card and f"{feature}" in card


def test_attribution_graph_errors_are_readable(tiny_server):
    client = Client(tiny_server, verbose=False)
    with pytest.raises(AppError, match="Build the attribution graph first"):
        client.predict("0_1_2", api_name="/circuit_feature")
    with pytest.raises(AppError, match="needs transcoders.*this model has tc_l0, tc_l1"):
        client.predict(ATTR_PROMPT, [], 0.95, 0.98, api_name="/circuit_attribution")
    with pytest.raises(AppError, match="The prompt is 70 tokens; the limit is 64"):  # the model's context, no cap
        client.predict(" ".join(["w3"] * 70), ["tc_l0"], 0.95, 0.98, api_name="/circuit_attribution")
    client.predict(ATTR_PROMPT, ["tc_l1"], 0.95, 0.98, api_name="/circuit_attribution")
    with pytest.raises(AppError, match="Layer 0 has no transcoder in this graph"):
        client.predict("0_1_2", api_name="/circuit_feature")


# 55 tokens over both transcoders: ~3,800 nodes, 58 backward batches (14 s on this loaded 2-core machine), long
# enough to be cancelled at its first reported batches.
LONG_ATTR_PROMPT = " ".join(f"w{3 + (i * 7) % 100}" for i in range(55))


def test_a_running_attribution_graph_reports_progress_and_cancel_frees_the_worker(tiny_server, tiny, transcoders):
    """The graph reports each backward batch ("attributed k of N targets"); Cancel stops it there, and the next
    graph, queued in the same one-at-a-time worker, is served (checked by order of completion, not by time)."""
    alice = Client(tiny_server, verbose=False)
    names = ["tc_l0", "tc_l1"]
    job = alice.submit(LONG_ATTR_PROMPT, names, 0.95, 0.98, api_name="/circuit_attribution")
    while not any("attributed" in str(out[3]) for out in job.outputs()):  # its first batches are done
        assert not job.done(), job.exception()
        time.sleep(0.1)
    said = next(str(out[3]) for out in job.outputs() if "attributed" in str(out[3]))
    done, total = (int(x.replace(",", "")) for x in re.search(r"attributed ([\d,]+) of ([\d,]+)", said).groups())
    assert 0 < done < total  # caught mid-way
    assert alice.predict(api_name="/circuit_attribution_cancel") == "Cancelled."
    job.cancel()
    # the worker is free again: the next graph (queued behind what is left of the cancelled one) is built
    plot, table, path, status = alice.predict(ATTR_PROMPT, names, 0.95, 0.98, api_name="/circuit_attribution")
    tcs = [load_sae(transcoders / name, model=tiny) for name in names]
    expected = slmviz.attribution_graph(ATTR_PROMPT, transcoders=tcs, model=tiny, progress=False)
    assert f"{expected.n_features} active features" in status and "computed in" in status
    while not job.done():
        time.sleep(0.1)
    assert not any("computed in" in str(out[3]) for out in job.outputs())  # the long graph never finished


def test_the_bundled_model_fills_ioi_and_greater_than_and_refuses_exact(smol_server):
    client = Client(smol_server, verbose=False)
    assert {value for _, value in TASK_CHOICES} == {"ioi", "induction", "greater-than"}
    clean, corrupted, answer, wrong, note = client.predict("ioi", 0, api_name="/circuit_task")
    assert answer.strip() in clean and wrong.strip() in clean and wrong.strip() not in corrupted.split(",")[-1]
    clean, corrupted, answer, wrong, note = client.predict("greater-than", 1, api_name="/circuit_task")
    assert "from the year" in clean and "01 to the year" in corrupted
    assert (answer, wrong) == ("", "") and "task's own metric" in note
    with pytest.raises(AppError, match=f"70,651 edges, more than this app runs \\({EXACT_MAX_EDGES:,}"):
        run(client, clean=clean, corrupted=corrupted, answer="", wrong="")


def test_another_sessions_run_during_a_long_job_finishes_first_and_cancel_stops_it(smol_server):
    alice, bob = Client(smol_server, verbose=False), Client(smol_server, verbose=False)
    from app.shared import EXAMPLE_ANSWER, EXAMPLE_CLEAN, EXAMPLE_CORRUPTED, EXAMPLE_WRONG

    job = alice.submit(EXAMPLE_CLEAN, EXAMPLE_CORRUPTED, EXAMPLE_ANSWER, EXAMPLE_WRONG, "eap-ig", 20, 30,
                       api_name="/circuit_run")
    while not job.outputs():  # the first status line: the job runs
        assert not job.done(), job.exception()
        time.sleep(0.2)
    tokens, *_ = bob.predict("The capital of France is", False, 1, "all", ["pre", "mid", "post"], False, False, True,
                             api_name="/run")
    assert "France" in tokens
    assert not job.done()  # bob's Run was served beside the job, not queued behind it
    assert alice.predict(api_name="/circuit_cancel") == "Cancelled."
    job.cancel()
    while not job.done():
        time.sleep(0.2)
    assert "Scored in" not in str(job.outputs()[-1][2])
    # the worker is free again: the next run (queued behind what is left of the cancelled one) finishes
    *_, status, table, _, _ = alice.predict(EXAMPLE_CLEAN, EXAMPLE_CORRUPTED, EXAMPLE_ANSWER, EXAMPLE_WRONG, "eap",
                                            5, 5, api_name="/circuit_run")
    assert "Scored in" in status and len(table["data"]) == 5
