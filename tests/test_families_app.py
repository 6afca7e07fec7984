"""The app on GPT-2, Pythia (GPT-NeoX) and Gemma 2: the Model tab loads a tiny folder of each
(`--allow-local-models`), Run traces it, and Break it offers that family's presets, runs them, and refuses the
presets of other families. Not covered: hub ids (no network here), and the Graph / Features tabs on these families.
"""

from __future__ import annotations

import pytest
from app_helpers import app_server
from family_models import NEW_FAMILIES, build_family_model
from gradio_client import Client

from app.variant_fields import VARIANT_FIELDS, widget_value
from slmviz.variants import PRESETS

pytestmark = pytest.mark.app

PROMPT = "w3 w4 w5 w6 w7 w8 w9 w10"
STAGES = ["pre", "mid", "post"]
# Each family's own presets, and one it must refuse.
OWN = {"gpt2": ["rms_for_layernorm", "no_pos_embed", "post_norm"],
       "gpt_neox": ["sequential_residual", "rotary_full", "rms_for_layernorm"],
       "gemma2": ["no_softcap", "pre_norm_only", "no_norm_offset"]}
FOREIGN = {"gpt2": "no_softcap", "gpt_neox": "no_pos_embed", "gemma2": "rotary_full"}


def preset_fields(name: str) -> list:
    return [widget_value(f, getattr(PRESETS[name].variant, f)) for f in VARIANT_FIELDS]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("family-folders")
    return {arch: build_family_model(root / arch, arch) for arch in NEW_FAMILIES}


def test_the_model_tab_loads_each_family_and_run_and_break_it_work_there(folders):
    with app_server(model=str(folders["gpt2"]), allow_local_models=True) as url:
        client = Client(url, verbose=False)
        for arch, folder in folders.items():
            status, *_ = client.predict(str(folder), api_name="/load_model")
            assert f"({arch}," in status, status
            tokens, _attention, _residual, _table, ran, *_ = client.predict(
                PROMPT, False, 1, "all", STAGES, False, False, True, api_name="/run")
            assert ran.startswith("Traced") and f"**{arch}**" in ran and tokens.count('title="position') >= 8
            for name in OWN[arch]:
                *values, description = client.predict(name, api_name="/preset")
                assert values == preset_fields(name) and name in description
            verdict, *_ = client.predict(PROMPT, False, *preset_fields(OWN[arch][0]), 1, "0", 4, api_name="/compare")
            assert verdict
            table = client.predict(PROMPT, False, api_name="/compare_all")
            assert set(OWN[arch]) <= {row[0] for row in table["data"]}
            with pytest.raises(Exception, match="not in the list of choices"):
                client.predict(FOREIGN[arch], api_name="/preset")
