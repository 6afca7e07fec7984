"""The Features tab over HTTP (gradio_client against a real server), on a small random SAE for the bundled model
listed through $SLMVIZ_SAE_DIRS: a feature's page (its numbers checked against a scan run here), the prompt's
features per token, the two searches, steering, loading SAEs in the Model tab, and every bad input the issue
lists, each a readable message after which the server keeps serving.

Does not cover: the page itself (tests/test_features_browser.py), the SAE formulas and files (tests/test_sae*.py),
the job runner (tests/test_scan_jobs.py), nor a hub that answers (no network here).
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from app_helpers import TEST_CORPUS_DOCS, TEST_SAE_FEATURES, TEST_SAE_HOOK, TEST_SAE_NAME, app_server, write_test_sae
from gradio_client import Client
from gradio_client.exceptions import AppError
from safetensors.torch import save_file

import slmviz
from app.saes import SAEStore
from app.scans import corpus_docs
from slmviz import SAE
from slmviz.features.dashboard import firing_stats, search_features, top_features

pytestmark = pytest.mark.app

PROMPT = "In the beginning God created the heaven and the earth."
FEATURE_LINK = re.compile(r'data-feature="(\d+)"')


@pytest.fixture(scope="module")
def sae_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    write_test_sae(root / "listed")
    return root


@pytest.fixture(scope="module")
def server(sae_root):
    env = {"SLMVIZ_SAE_DIRS": str(root_listed(sae_root)), "SLMVIZ_HUB_TIMEOUT": "5"}
    with app_server(env=env, allow_local_models=True) as url:
        yield url


def root_listed(root):
    return root / "listed"


@pytest.fixture()
def client(server):
    return Client(server, verbose=False)


@pytest.fixture(scope="module")
def test_sae(sae_root, model):
    return slmviz.load_sae(root_listed(sae_root) / TEST_SAE_NAME, model=model)


def test_the_feature_endpoints_are_named(client):
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/feature_show", "/feature_prompt", "/feature_token", "/feature_search", "/steer", "/load_sae",
            "/feature_cancel", "/sae_train", "/sae_train_cancel"} <= names


def test_a_features_page_shows_the_scans_numbers_logit_effects_and_nearest_features(client, model, test_sae):
    acts = f"{TEST_SAE_HOOK}.hook_sae_acts_post"
    scan = slmviz.scan(corpus_docs(TEST_CORPUS_DOCS), hooks=[acts], top_k=10, model=model,
                       saes=[test_sae], progress=False)
    feature = int(scan.max(acts).argmax())  # the hardest-firing feature: it has contexts to show
    shown, card = client.predict(TEST_SAE_NAME, feature, api_name="/feature_show")
    assert shown == feature and f"Feature {feature} of {TEST_SAE_NAME}" in card
    stats = firing_stats(scan, test_sae, feature)
    assert f"max activation <b>{stats['max']:.3g}</b>" in card and f"of {stats['tokens']} scanned tokens" in card
    assert card.count('class="slmviz-feature-context"') >= 1 and "quantile band" in card
    effects = test_sae.logit_effects(feature, k=10, model=model)
    top = effects[effects.kind == "promoted"].iloc[0]
    assert f"{top.effect:+.3g}" in card  # the library's logit effects, in the card
    nearest = [int(f) for f in FEATURE_LINK.findall(card.split("Nearest features")[1])]
    assert nearest == test_sae.nearest(feature, k=10).feature.tolist()


def test_a_feature_scan_drops_the_rows_training_drops_and_leaves_the_model_unchanged(model, test_sae):
    """The first position's massive activation would otherwise top every feature's contexts (SAE.shown_rows)."""
    acts = f"{TEST_SAE_HOOK}.hook_sae_acts_post"
    plain = model.trace(PROMPT)
    spliced = model.trace(PROMPT, saes=[test_sae])
    assert torch.equal(spliced.logits, plain.logits)
    kept = top_features(spliced, test_sae).groupby("position").kept.first()
    assert spliced[acts][0].any() and not kept[0] and kept[1:].all()  # no other row of this prompt is massive
    scan = slmviz.scan(corpus_docs(8), hooks=[acts], top_k=5, model=model, saes=[test_sae], progress=False)
    assert scan.info["sae_rows"] == [acts]
    top = scan.all_top_examples()
    assert not (top[top.activation > 0].position == 0).any()


def test_the_prompts_features_per_token_and_a_click_on_a_token(client, model, test_sae):
    tokens, features = client.predict(PROMPT, False, TEST_SAE_NAME, api_name="/feature_prompt")  # + a gr.State
    n = len(model.encode(PROMPT))
    assert tokens.count('class="slmviz-feature-token"') == n
    acts = model.trace(PROMPT, saes=[test_sae])[f"{TEST_SAE_HOOK}.hook_sae_acts_post"]
    at_3 = client.predict(3, api_name="/feature_token")
    assert int(FEATURE_LINK.findall(at_3)[0]) == int(acts[3].argmax())  # the strongest feature first
    assert "skipped" in client.predict(0, api_name="/feature_token")  # the first position: a massive activation
    assert FEATURE_LINK.findall(features)  # the last token's features come with the prompt


def test_searching_for_features_that_promote_or_fire_on_a_token(client, model, test_sae):
    promoting = client.predict(TEST_SAE_NAME, " the", "promotes", api_name="/feature_search")
    expected = search_features(test_sae, " the", model=model).feature.tolist()
    assert [int(f) for f in FEATURE_LINK.findall(promoting)] == expected
    firing = client.predict(TEST_SAE_NAME, " God", "fires", api_name="/feature_search")
    assert FEATURE_LINK.findall(firing)  # " God" is all over Genesis
    with pytest.raises(AppError, match="is 2 tokens"):
        client.predict(TEST_SAE_NAME, " the earth", "promotes", api_name="/feature_search")


def test_steering_with_strength_0_changes_nothing_and_a_large_one_changes_the_continuation(client):
    args = ("The capital of France is", False, TEST_SAE_NAME, 5)
    default, steered = client.predict(*args, 0, 12, 0, 0, api_name="/steer")
    assert default == steered and default
    default, steered = client.predict(*args, 200, 12, 0, 0, api_name="/steer")
    assert steered != default
    sampled = [client.predict(*args, 200, 12, 1.0, 7, api_name="/steer") for _ in range(2)]
    assert sampled[0] == sampled[1]  # the same seed: the same two continuations


def _save_bad(folder, tensors=None, cfg_changes=None):
    """A SAELens folder made from the test SAE, with some tensors or cfg.json fields replaced."""
    sae = SAE.random(576, 16, seed=1, architecture="relu", hook_name=TEST_SAE_HOOK)
    sae.save(folder)
    if tensors is not None:
        state = {k: v.detach() for k, v in sae.state_dict().items()}
        state.update(tensors)
        save_file({k: v for k, v in state.items() if v is not None}, str(folder / "sae_weights.safetensors"))
    if cfg_changes:
        cfg = json.loads((folder / "cfg.json").read_text())
        cfg.update(cfg_changes)
        (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


def test_bad_saes_are_readable_errors_and_the_app_keeps_serving(client, tmp_path):
    other_width = SAE.random(64, 16, seed=0, hook_name=TEST_SAE_HOOK).save(tmp_path / "width")
    no_hook = SAE.random(576, 16, seed=0, hook_name="blocks.3.ln1_post.hook_normalized").save(tmp_path / "gemma")
    pickle = tmp_path / "pickle"
    pickle.mkdir()
    torch.save({"W_enc": torch.zeros(2, 2)}, pickle / "sae_weights.pt")
    cases = {
        other_width: "this SAE was made for another model",
        no_hook: "have no 'ln1_post.hook_normalized' hook",
        _save_bad(tmp_path / "missing", tensors={"W_dec": None}): "W_dec",
        _save_bad(tmp_path / "shape", tensors={"W_dec": torch.zeros(16, 100)}): "W_dec",
        _save_bad(tmp_path / "nan", tensors={"W_enc": torch.full((576, 16), float("nan"))}): "non-finite",
        pickle: "pickle",
        _save_bad(tmp_path / "arch", cfg_changes={"architecture": "gated"}): "supported: ",
    }
    for folder, message in cases.items():
        with pytest.raises(AppError, match=re.escape(message)):
            client.predict(str(folder), "", api_name="/load_sae")
    with pytest.raises(AppError, match="could not fetch|did not answer"):  # no network: bounded by the timeout
        client.predict("google/gemma-scope-2-270m-pt", "resid_post/layer_9_width_16k_l0_medium",
                       api_name="/load_sae")
    with pytest.raises(AppError, match=f"out of range: this SAE has d_sae={TEST_SAE_FEATURES}"):
        client.predict(TEST_SAE_NAME, TEST_SAE_FEATURES, api_name="/feature_show")
    with pytest.raises(AppError, match="not an SAE for|not in the list of choices"):  # looked up, never read as a path
        client.predict(str(other_width), 0, api_name="/feature_show")
    shown, card = client.predict(TEST_SAE_NAME, 1, api_name="/feature_show")  # still serving
    assert shown == 1 and "Feature 1" in card


def test_an_sae_loaded_in_the_model_tab_is_offered_and_shown(client, tmp_path):
    folder = write_test_sae(tmp_path, "loaded", seed=3)
    status, picker = client.predict(str(folder), "", api_name="/load_sae")
    assert "Loaded" in status and str(folder) in status
    shown, card = client.predict(str(folder), 2, api_name="/feature_show")
    assert shown == 2 and "Feature 2 of" in card


def test_the_store_lists_the_folders_that_fit_and_reads_no_other_path_unless_allowed(sae_root, model, tmp_path,
                                                                                    monkeypatch):
    SAE.random(64, 16, seed=0, hook_name=TEST_SAE_HOOK).save(tmp_path / "other_model")
    write_test_sae(tmp_path)
    monkeypatch.setenv("SLMVIZ_SAE_DIRS", str(tmp_path))
    store = SAEStore(allow_local=False)
    names = store.names(model)
    assert TEST_SAE_NAME in names and "other_model" not in names  # the misfit is logged and left out
    assert store.get(model, TEST_SAE_NAME).sae.d_sae == TEST_SAE_FEATURES
    with pytest.raises(ValueError, match="--allow-local-models"):
        store.load(model, str(root_listed(sae_root) / TEST_SAE_NAME))
    with pytest.raises(ValueError, match="not an SAE for"):  # a name is looked up, never read as a path
        store.get(model, str(root_listed(sae_root) / TEST_SAE_NAME))
    with pytest.raises(ValueError, match="Pick an SAE|No SAE"):
        store.get(model, None)


def test_an_sae_trained_in_the_tab_reports_its_figures_and_is_offered_to_that_session_only(server):
    """A tiny run (6k tokens of the bundled verses at layer 1): the status ends with the last step's loss,
    explained variance, L0 and dead fraction, the picker switches to the new SAE, which this session can use and
    another cannot pick. Bad settings are readable errors."""
    alice, bob = Client(server, verbose=False), Client(server, verbose=False)
    status, picker = alice.predict("blocks.1.hook_resid_post", "", 64, 4, 6000, "bible", api_name="/sae_train")
    picked = picker["value"] if isinstance(picker, dict) else picker  # an update: {"value": ..., "choices": ...}
    assert picked.startswith("trained #") and "blocks.1.hook_resid_post" in picked, picked
    for figure in ("Trained", "loss", "explained variance", "L0 4.0", "dead"):
        assert figure in status, status
    tokens_html, _ = alice.predict(PROMPT, False, picked, api_name="/feature_prompt")
    assert "slmviz-feature-token" in tokens_html
    with pytest.raises(AppError, match="not in the list of choices|not an SAE for"):
        bob.predict(PROMPT, False, picked, api_name="/feature_prompt")
    for args, message in ((("blocks.99.hook_resid_post", "", 64, 4, 1000), "hook"),
                          (("blocks.1.hook_resid_post", "", 64, 65, 1000), "k must be a whole number from 1 to 64"),
                          (("blocks.1.hook_resid_post", "", 0, 4, 1000), "width must be|less than minimum"),
                          (("blocks.1.hook_resid_post", "", 64, 4, 10**9), "tokens must be|greater than maximum")):
        with pytest.raises(AppError, match=message):
            alice.predict(*args, "bible", api_name="/sae_train")


def test_a_training_run_shows_progress_is_cancellable_and_another_session_is_served_before_it(server):
    """Order of completion, not time: bob's Run, asked while alice's training runs in the job worker, finishes
    before it; alice's Cancel over the API stops it, and it never reports a trained SAE."""
    alice, bob = Client(server, verbose=False), Client(server, verbose=False)
    job = alice.submit("blocks.1.hook_resid_post", "", 256, 8, 400_000, "bible", api_name="/sae_train")
    while not any("explained variance" in str(out[0]) for out in job.outputs()):  # a step's figures: it trains
        assert not job.done(), job.exception()
        time.sleep(0.2)
    assert "explained variance" in job.outputs()[-1][0]
    tokens, *_ = bob.predict("The capital of France is", False, 1, "all", ["pre", "mid", "post"], False, False, True,
                             api_name="/run")
    assert "France" in tokens
    assert not job.done()  # bob was served beside the training run, not queued behind it
    assert alice.predict(api_name="/sae_train_cancel") == "Training cancelled."
    job.cancel()
    while not job.done():
        time.sleep(0.2)
    assert not any("Trained" in str(out[0]) for out in job.outputs())


def test_the_store_offers_a_trained_sae_to_its_session_only(model):
    store = SAEStore()
    entries = [store.add_trained(model, "alice", SAE.random(576, 16, seed=i, hook_name=TEST_SAE_HOOK))
               for i in range(4)]
    assert [e.name for e in entries[1:]] == [n for n in store.names(model, "alice") if n.startswith("trained")]
    assert not any(n.startswith("trained") for n in store.names(model, "bob") + store.names(model))
    assert store.get(model, entries[-1].name) is entries[-1]
