"""Shared fixtures: the real default model, and tiny random checkpoints built by transformers itself."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Keep CPU runs reproducible and leave a core for the server processes some tests start.
torch.manual_seed(0)

# Under pytest-xdist (`make test` runs two workers on a 2-core machine) each worker, and every server or
# subprocess it starts, computes on one thread: two workers with two OpenMP threads each would put four spinning
# threads on two cores, and OpenMP's barriers then wait for the OS to run a descheduled thread, which slows every
# parallel op many times over.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def keep_freed_memory_until_the_module_ends() -> None:
    """glibc: serve large tensors from the heap (M_MMAP_MAX 0) and do not hand freed memory back on each free
    (M_TRIM_THRESHOLD), so that a test's 560 MB logits reuse the pages the last one freed; the heap goes back to
    the OS once a module ends (pytest_runtest_teardown's malloc_trim). Why: on the virtual machines the suite runs
    on, memory handed back is soon reclaimed by the host, and touching it again costs the kernel more than the
    arithmetic of the Gemma tests that make it (bench/perf/fresh_memory.py; bench/results/notes.md, "make test's
    CPU").
    Only this process: the servers and subprocesses it starts keep glibc's defaults."""
    import contextlib
    import ctypes

    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(m_mmap_max, 0)
        libc.mallopt(m_trim_threshold, 1 << 30)  # an int: 1 GB of free heap top kept


keep_freed_memory_until_the_module_ends()


def share_one_ssl_context_between_http_clients() -> None:
    """gradio_client opens a new httpx client for each call it makes (a prediction's POST, its event stream, a GET),
    and each client builds an SSL context that parses certifi's whole CA bundle, even to talk plain http to a test
    server: over a whole run, one of the largest costs of the test process (bench/results/notes.md, "The night of
    2026-12-07"). This process keeps the first context built for each set of arguments; the servers and the library
    are untouched."""
    import functools

    from httpx._transports import default

    cached = functools.lru_cache(maxsize=8)(default.create_ssl_context)

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        try:
            return cached(verify, cert, trust_env)
        except TypeError:  # arguments that cannot be a cache key (an SSLContext of the caller's, a dict)
            return cached.__wrapped__(verify, cert, trust_env)

    default.create_ssl_context = create_ssl_context


share_one_ssl_context_between_http_clients()

TINY_BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
)

# name -> (config class name, extra kwargs): every option point 3 of the core issue lists.
TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "llama_gqa": ("LlamaConfig", {}),
    "llama_mha": ("LlamaConfig", {"num_key_value_heads": 4}),
    "llama_mqa_tied": ("LlamaConfig", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama_bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "llama_head_dim": ("LlamaConfig", {"head_dim": 24}),
    "llama_linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
    "llama_dynamic": ("LlamaConfig", {"max_position_embeddings": 16,
                                      "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}),
    "llama3": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 500000.0}}),
    "qwen2": ("Qwen2Config", {}),
    "qwen2_tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"sliding_window": 4096}),
    "mistral_window": ("MistralConfig", {"sliding_window": 5}),
    # Families with their own conventions (docs/correctness.md, the families). hidden_size 80: sqrt(80) is not
    # exact in low precision, so an embedding scale in the wrong dtype would show. Gemma: MQA, sliding (window
    # 4) and global layers with different RoPE bases, query_pre_attn_scalar != head_dim.
    "gemma3": ("Gemma3TextConfig", {
        "hidden_size": 80, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 4, "query_pre_attn_scalar": 24,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}}),
    "qwen3": ("Qwen3Config", {"hidden_size": 80, "head_dim": 24}),
    "olmo2": ("Olmo2Config", {"hidden_size": 80}),
}


def build_tiny_model(folder: Path, arch: str, seed: int = 0) -> Path:
    """Save a random-weight checkpoint of `arch` with transformers' own classes (non-unit norm weights)."""
    import transformers

    cls_name, extra = TINY_ARCHS[arch]
    config = getattr(transformers, cls_name)(**{**TINY_BASE, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))  # non-unit: a skipped norm weight must show
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    _write_tokenizer(folder, config.vocab_size)
    return folder


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tiny word-level tokenizer (no download): ids 0..vocab-1, so random models have a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["<unk>"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="w1")
    fast.save_pretrained(folder)


@pytest.fixture()
def two_threads():
    """torch on two threads for one test, whatever its worker runs on: for what exists only with several threads (the
    one-row kernel's OnlineChoice, parallel atomic adds). Only for that: beside the other test worker on a 2-core
    machine, two threads wait on each other at every op, and a test of many small ops runs many times slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_dir(tiny_dirs) -> Path:
    return tiny_dirs["llama_gqa"]


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    import slmviz

    return slmviz.load(tiny_dir)


@pytest.fixture(scope="session")
def model():
    """The real bundled SmolLM2-135M-Instruct (prepared by `make test` before pytest runs)."""
    import slmviz

    return slmviz.load()


@pytest.fixture(scope="session")
def hf_model(model):
    from slmviz.loading.reference import load_reference

    return load_reference(model.path)


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium for one browser test module (each skips itself when Chromium is missing)."""
    from app_helpers import CHROMIUM, CHROMIUM_ARGS
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="session")
def server():
    """The app on its default settings, served from a subprocess once per test worker and shared by every module
    that asks for it (a module that needs other settings defines its own `server`): a start costs a model load and
    the page's build, 10-20 s, and eight modules ask for this one.

    What a module does stays in its own sessions (gr.State, one per client or page). What the server shares between
    sessions is the model store, the scans it has made and the SAEs loaded in the Model tab, which none of these
    modules counts on being empty. The tiny model's server is not shared: tests/test_workbench_app.py compares a
    node's label with the library's, and a feature scan made there by another module changes the label. (The one
    failure of an earlier shared server, an error toast naming transcoder_l6 after a switch to Gemma, was a race
    inside one session, since fixed: app/tabs/graph_scan.py's offer_after.)"""
    from app_helpers import app_server

    with app_server() as url:
        yield url


@pytest.fixture()
def page(request, browser, server):
    """A page on the module's server that records every host it contacts (`page.hosts`); its viewport height is
    the module's PAGE_HEIGHT (default 1100)."""
    from app_helpers import recording_page

    with recording_page(browser, server, height=getattr(request.module, "PAGE_HEIGHT", 1100)) as pg:
        yield pg


def pytest_sessionfinish(session):
    write_file_seconds()
    if "app_helpers" in sys.modules:  # only where a test started an app server
        sys.modules["app_helpers"].stop_forkserver()


def pytest_collection_finish(session):
    """Move everything alive once the tests are collected (torch, transformers, gradio, every test module) out of
    the garbage collector's reach: it lives as long as the process, and each full collection walked all of it,
    conftest's own at the end of every module included (bench/results/notes.md, "The night of 2026-12-07"). What
    the tests make afterwards is collected as before."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_report_header(config):
    cache = os.environ.get("SLMVIZ_CACHE", "~/.cache/slmviz")
    return f"torch {torch.__version__}, threads {torch.get_num_threads()}, SLMVIZ_CACHE={cache}"


# The order in which `make test`'s workers take modules (pytest-xdist's loadfile, with --no-loadscope-reorder so
# that this order stands): longest first, so that the many quick ones fill in at the end and the workers finish
# together (xdist's own reorder, most tests first, put the long app modules last, where one worker ran them alone).
# A module's cost is its seconds in FILE_SECONDS (a CI run's, written with SLMVIZ_FILE_SECONDS=path; only the order
# reads it), else its class: those that drive Chromium, then those that start the app, then those that load the
# real models, then the rest.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
MODULE_COST_ORDER = ("browser", "app", "slow")


def pytest_collection_modifyitems(config, items):
    import json

    seconds = json.loads(FILE_SECONDS.read_text(encoding="utf-8")) if FILE_SECONDS.exists() else {}

    def cost(item) -> tuple[int, float]:
        module = item.nodeid.split("::")[0]
        marks = module_marks[module]
        cls = next((i for i, name in enumerate(MODULE_COST_ORDER) if name in marks), len(MODULE_COST_ORDER))
        known = seconds.get(Path(module).name)
        return (0, -known) if known is not None else (1 + cls, 0.0)

    module_marks: dict[str, set[str]] = {}
    for item in items:
        module_marks.setdefault(item.nodeid.split("::")[0], set()).update(m.name for m in item.iter_markers())
    items.sort(key=cost)  # stable: each module's own order is kept


# The modules that load the bundled Gemma 3 (fp32) in the test process: `make test` runs them on one worker, one
# after another, so that the worker's shared Gemma (slmviz.load's cache) is loaded and paged in once, not once on
# each worker (its weights paged in afresh each time: bench/results/notes.md, "Idle servers and pages").
GEMMA_MODULES = frozenset({"test_bundled.py", "test_circuits_tasks.py", "test_families.py",
                           "test_logit_attribution.py", "test_sae_splice.py", "test_sae_train.py"})


@pytest.hookimpl(optionalhook=True)  # known only where xdist is loaded (not under -p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """xdist's loadfile, each module one unit of work, except GEMMA_MODULES: one unit together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GemmaModulesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "the Gemma modules" if Path(module).name in GEMMA_MODULES else module

    return GemmaModulesTogether(config, log)


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Each module's seconds (setup, call and teardown of its tests), summed where the reports arrive (xdist's
    controller), for SLMVIZ_FILE_SECONDS."""
    if os.environ.get("SLMVIZ_FILE_SECONDS"):
        name = Path(report.nodeid.split("::")[0]).name
        _file_seconds[name] = _file_seconds.get(name, 0.0) + report.duration


def write_file_seconds() -> None:
    import json

    out = os.environ.get("SLMVIZ_FILE_SECONDS")
    if out and _file_seconds and not os.environ.get("PYTEST_XDIST_WORKER"):
        ranked = dict(sorted(((k, round(v, 1)) for k, v in _file_seconds.items()), key=lambda kv: -kv[1]))
        Path(out).write_text(json.dumps(ranked, indent=1) + "\n", encoding="utf-8")


def pytest_runtest_teardown(item, nextitem):
    """After a module's last test: collect its garbage and hand the freed heap back to the OS (glibc's malloc_trim),
    so a worker's memory is what its current module holds, not the peak of every module it ran (the real models'
    tensors are freed into glibc's arenas, which keep them otherwise)."""
    if nextitem is None or nextitem.module is not item.module:
        import gc

        from slmviz.training.loop import release_freed_memory

        gc.collect()
        release_freed_memory()
