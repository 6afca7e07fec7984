"""The broad corpus's documents: which installed distributions give its prose, and the fixed order that every set
trained on a prefix of it (the quick set) relies on."""

from __future__ import annotations

import importlib.metadata

import pytest
from packaging.utils import canonicalize_name

from slmviz.corpora import broad


def test_the_fixed_order_moves_no_document_when_another_is_added_or_removed():
    docs = [f"document {i}" for i in range(200)]
    order = broad.stable_order(docs, key=str)
    assert sorted(order) == sorted(docs) and order != docs  # a shuffle, not the input order
    assert broad.stable_order(list(reversed(docs)), key=str) == order  # the input order does not matter
    more = broad.stable_order([*docs, "one more README"], key=str)
    assert [d for d in more if d != "one more README"] == order
    fewer = broad.stable_order(docs[1:], key=str)
    assert fewer == [d for d in order if d != docs[0]]


def test_prose_comes_from_slmviz_runtime_dependencies_not_from_whatever_else_is_installed(monkeypatch):
    """Installing pytest-xdist (the test runner's workers) changed the corpus, and with it the quick set's weights:
    only slmviz's own requirements, every level down, give READMEs and licences; a checkout that is not installed
    reads its requirements from pyproject.toml and finds the same."""
    names = [canonicalize_name(d.metadata["Name"]) for d in broad.runtime_distributions()]
    assert {"torch", "transformers", "safetensors", "gradio"} <= set(names)
    assert names == sorted(names)
    installed = {canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    assert {"pytest", "pytest-xdist"} <= installed  # the test extra is installed here, and left out
    assert not {"pytest", "pytest-xdist", "execnet", "mkdocs", "ruff"} & set(names)

    def not_installed(name: str) -> list[str]:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(broad.importlib.metadata, "requires", not_installed)
    assert [canonicalize_name(d.metadata["Name"]) for d in broad.runtime_distributions()] == names


@pytest.mark.parametrize("marker, kept", [('; extra == "test"', False), ('; python_version >= "3"', True)])
def test_a_requirement_behind_an_extra_is_not_followed(monkeypatch, marker, kept):
    monkeypatch.setattr(broad, "_own_requirements", lambda: [f"safetensors{marker}"])
    assert bool(broad.runtime_distributions()) == kept
