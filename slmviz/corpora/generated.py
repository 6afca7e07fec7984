"""The "chat" corpus: text the model itself writes from varied seeds of the kind people type, generated offline.

    train, heldout = chat_corpus(m)       # $SLMVIZ_CACHE/sae_corpus/chat-{model}/{train,heldout}.jsonl, made once

Why the model's own text: coders trained on the broad corpus (code, pydoc, licences, the King James Bible) explain
the prompts users type worse (SmolLM2's resid_post_l15: EV 0.70 on a dozen modern sentences against 0.83 on the
broad corpus's own held-out split). Nothing else offline has modern prose and chat turns, and an instruct model's
own continuations of news openings, facts, dialogue and chat questions are, by construction, the distribution its
activations meet when people use it.

How: SEEDS are short openings in six registers (news, encyclopaedic facts, dialogue, everyday prose, how-to, chat
questions; chat seeds are wrapped in the model's chat template, so the chat turn tokens are in the corpus too).
Each batch continues one seed `SAMPLES_PER_SEED` times at once (one padded-free [b, pos] forward per step with a
batched KV cache: every row has the seed's length), sampled at temperature TEMPERATURE with top-k TOP_K from a
generator seeded by (seed index, round), so the corpus is a pure function of the model's weights and these
constants. Documents are seed + continuation; 5 % of seeds (by a hash of the seed text) are held out whole, so the
held-out split never shares an opening with the training split. Each seed's batch is written to its own part file
as it finishes, so an interrupted generation resumes at the next seed (measured time in docs/features.md).
On a CPU, `generation_workers()` seeds are decoded at once, each on one thread (why: its docstring); the text is the
same as one seed at a time on every thread.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from ..progress import ProgressLike, as_progress

SAMPLES_PER_SEED = 24  # rows of one batched generation
NEW_TOKENS = 128
TEMPERATURE = 0.9
TOP_K = 50
HELDOUT_PERCENT = 5
ROUNDS = 1  # how many times each seed is continued SAMPLES_PER_SEED times

NEWS = [
    "BREAKING: The city council voted on Tuesday to", "Shares of the electric carmaker fell sharply after",
    "Scientists announced a new discovery about", "The government said on Monday that it would",
    "Heavy rain caused flooding across the region, and", "The central bank kept interest rates unchanged, saying",
    "In a surprise move, the team signed", "Officials confirmed that the wildfire", "The election results show that",
    "A new study published this week suggests that", "Local residents gathered outside the school to",
    "The tech company unveiled its latest smartphone,", "Health officials are urging people to",
    "After months of negotiations, the two countries", "The museum reopened to visitors after",
]
FACTS = [
    "The capital of France is", "Water boils at", "The Great Wall of China was built", "Photosynthesis is the process",
    "The Amazon rainforest covers", "Mount Everest is the highest", "The human heart has four chambers",
    "Shakespeare wrote", "The speed of light is", "The Roman Empire fell", "DNA stands for", "The Moon orbits",
    "Tokyo is the capital of", "The first person to walk on the Moon was", "Dallas is a city in the state of",
    "The largest planet in our solar system is", "The Eiffel Tower is located in", "Albert Einstein is known for",
    "Penguins live mostly in", "The Pacific Ocean is",
]
DIALOGUE = [
    '"Where are you going?" asked Mary. John replied,', "Tom: Did you finish the report?\nAnna:",
    "When Mary and John went to the store, John gave a drink to", '"I can\'t believe it," she said. "',
    "Customer: Hi, I'd like to return these shoes.\nClerk:", "Interviewer: Tell me about yourself.\nCandidate:",
    "Mom: Have you done your homework?\nSam:", '"We need to talk," said the captain, looking at',
    "Alice and Bob were arguing about", "Doctor: How long have you had these symptoms?\nPatient:",
]
PROSE = [
    "I woke up early this morning and", "My favourite thing about summer is", "Last weekend we drove to the coast and",
    "The best way to learn a new language is", "She opened the letter and", "Yesterday at work, my manager",
    "Our neighbours just got a new puppy, and", "The restaurant on the corner serves", "Every year in the autumn,",
    "The train was late again, so", "He had always wanted to become a", "The old house at the end of the street",
    "When I was a child, I used to", "The movie was surprisingly good because", "Running a small business means",
]
HOWTO = [
    "To make a good cup of coffee, first", "Here is how to change a flat tire:", "Step 1: Preheat the oven to",
    "The easiest way to save money is", "To reset your password, click", "If you want to grow tomatoes,",
    "A simple recipe for pancakes:", "Before a job interview, you should", "To fix a leaking tap,",
    "Tips for sleeping better:",
]
CHAT = [
    "What is the capital of Australia?", "Can you explain how vaccines work?", "Write a short poem about the sea.",
    "How do I make pasta from scratch?", "What are the benefits of regular exercise?", "Who was Napoleon?",
    "Give me three ideas for a birthday party.", "Why is the sky blue?", "What's the difference between weather "
    "and climate?", "How can I improve my writing?", "Summarize the plot of Romeo and Juliet.",
    "What should I pack for a trip to Japan?", "Translate 'good morning' into Spanish and French.",
    "What is 17 plus 25?", "Explain what a black hole is to a child.", "Tell me a fun fact about octopuses.",
    "How does the stock market work?", "What are some good books for learning history?",
    "Can you help me write an email to my landlord about a broken heater?", "What causes earthquakes?",
    "Is coffee bad for you?", "What is machine learning?", "Recommend a healthy breakfast.",
    "What happened in 1969?", "How do airplanes stay in the air?",
]
SEEDS: list[tuple[str, str]] = [(kind, s) for kind, group in (("news", NEWS), ("fact", FACTS), ("dialogue", DIALOGUE),
                                ("prose", PROSE), ("howto", HOWTO), ("chat", CHAT)) for s in group]


def corpus_dir(model: Any, kind: str = "chat") -> Path:
    from ..loading.bundled import cache_dir

    return cache_dir() / "sae_corpus" / f"{kind}-{model.name}"


def held_out(seed_text: str) -> bool:
    return int.from_bytes(hashlib.sha256(seed_text.encode("utf-8")).digest()[:4], "little") % 100 < HELDOUT_PERCENT


def generation_jobs(rounds: int = ROUNDS, seeds: list[tuple[str, str]] | None = None
                    ) -> list[tuple[int, int, str, str]]:
    """The chat corpus's generation jobs, (round, seed index, kind, seed), in its own order: each part file's key."""
    seeds = SEEDS if seeds is None else seeds
    return [(r, i, kind, text) for r in range(rounds) for i, (kind, text) in enumerate(seeds)]


def chat_corpus(model: Any, folder: str | Path | None = None, progress: ProgressLike = True,
                rounds: int = ROUNDS, samples: int = SAMPLES_PER_SEED, new_tokens: int = NEW_TOKENS,
                seeds: list[tuple[str, str]] | None = None, workers: int | None = None) -> tuple[Path, Path]:
    """(train.jsonl, heldout.jsonl) of the model's own text (module docstring), generated once and reused. Each
    line: {"text", "source": "generated", "kind", "seed"}. `workers`: seeds decoded at once (default
    generation_workers(model)). A `progress` callable may raise to stop: the seeds being decoded stop at their next
    token, and the parts already written stay for the next call."""
    folder = Path(folder) if folder is not None else corpus_dir(model)
    train, heldout = folder / "train.jsonl", folder / "heldout.jsonl"
    if train.is_file() and heldout.is_file():
        return train, heldout
    seeds = SEEDS if seeds is None else seeds
    jobs = generation_jobs(rounds, seeds)
    parts = generate_parts(model, folder / "parts", jobs, progress, samples, new_tokens, workers,
                           desc=f"chat corpus ({model.name})")
    for out, held in ((train, False), (heldout, True)):
        _write_text(out, _joined(part for job, part in zip(jobs, parts, strict=True) if held_out(job[3]) == held))
    return train, heldout


def chat_heldout(model: Any, progress: ProgressLike = True) -> Path:
    """The chat corpus's held-out split alone, the same file chat_corpus writes: only its held-out seeds' parts are
    generated (a tenth of the jobs, minutes rather than the whole corpus's half hour), so evaluating a set on chat
    text does not first write the training text it was not trained on."""
    heldout = corpus_dir(model) / "heldout.jsonl"
    if heldout.is_file():
        return heldout
    jobs = [job for job in generation_jobs() if held_out(job[3])]
    parts = generate_parts(model, corpus_dir(model) / "parts", jobs, progress,
                           desc=f"chat corpus, held-out ({model.name})")
    _write_text(heldout, _joined(parts))
    return heldout


def _joined(parts: Iterable[Path]) -> str:
    return "".join(part.read_text(encoding="utf-8") for part in parts)


def generate_parts(model: Any, parts: Path, jobs: list[tuple[int, int, str, str]],
                   progress: ProgressLike = True, samples: int = SAMPLES_PER_SEED,
                   new_tokens: int = NEW_TOKENS, workers: int | None = None, desc: str = "chat corpus"
                   ) -> list[Path]:
    """Each job's part file (one JSON line a document), generating those not yet written into `parts` (one file per
    (round, seed), written when its batch is done: a restart skips them). `progress`: slmviz.progress's contract
    (True: a tqdm bar), counted in seed prompts written ("chat corpus 3 / 9 seed"); one that raises stops the
    workers and keeps the parts written."""
    parts.mkdir(parents=True, exist_ok=True)
    todo = [j for j in jobs if not _part(parts, j).is_file()]
    bar = as_progress(progress, desc)

    def finished(n: int) -> None:
        bar.update(len(jobs) - len(todo) + n, len(jobs), unit="seed")

    if todo:
        finished(0)
    _write_parts(model, parts, todo, samples, new_tokens, workers or generation_workers(model), finished)
    return [_part(parts, job) for job in jobs]


def generation_workers(model: Any) -> int:
    """How many seeds chat_corpus decodes at once: one per CPU thread (torch's count), each on one thread; 1 off
    the CPU.

    Why: a step decodes 24 rows, and most of its ops are too small to gain from a second thread, while each split
    still pays OpenMP's fork and join, so two seeds at once on one thread each finish sooner than one after the
    other on two threads (docs/features.md records the times). The text is
    the same: each row's numbers are one thread's dot products either way (seed 0's part, byte for byte), and
    each seed has its own generator. Pinned by tests/test_generated_corpus.py (workers 1 and 2 write the same
    corpus)."""
    if getattr(model, "device", torch.device("cpu")).type != "cpu":
        return 1
    return max(1, torch.get_num_threads())


class _Stopped(Exception):
    """Raised inside a worker's decoding once the caller has stopped (its progress callable raised)."""


def _write_parts(model: Any, parts: Path, todo: list[tuple[int, int, str, str]], samples: int, new_tokens: int,
                 workers: int, finished: Callable[[int], None]) -> None:
    """Decode each job's seed and write its part file, `workers` at a time; `finished(n)` after the n-th part (in
    this thread: it may raise, which stops the others at their next token and is raised here)."""
    stop = threading.Event()

    def one(job: tuple[int, int, str, str]) -> None:
        r, i, kind, text = job
        prompt = _chat_text(model, text) if kind == "chat" else text
        docs = sample_continuations(model, prompt, samples, new_tokens, seed=1000 * r + i, stop=stop)
        lines = [json.dumps({"text": doc, "source": "generated", "kind": kind, "seed": text}, ensure_ascii=False)
                 for doc in docs]
        tmp = _part(parts, job).with_suffix(f".{threading.get_ident()}.tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tmp.replace(_part(parts, job))

    if workers <= 1 or len(todo) <= 1:
        for n, job in enumerate(todo, 1):
            one(job)
            finished(n)
        return

    def on_one_thread(job: tuple[int, int, str, str]) -> None:
        torch.set_num_threads(1)  # this worker thread's OpenMP and MKL count (thread-local in ATen's OpenMP build)
        one(job)

    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="chat-corpus")
    try:
        pending = {pool.submit(on_one_thread, job) for job in todo}
        n = 0
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                future.result()  # a worker's error is raised here
                n += 1
                finished(n)
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(threads)  # the process-wide default the workers' set_num_threads(1) also changed


def _part(parts: Path, job: tuple[int, int, str, str]) -> Path:
    return parts / f"{job[0]}_{job[1]}.jsonl"


def mixed_corpus(model: Any, progress: ProgressLike = True) -> tuple[Path, Path]:
    """The broad corpus and the chat corpus interleaved line by line (train and held-out splits apart): what the
    prepared full sets train on, so the coders see code, prose and chat in every block."""
    return _mix(model, "mixed", _interleave, progress)


def balanced_corpus(model: Any, progress: ProgressLike = True) -> tuple[Path, Path]:
    """Half broad, half chat by characters (train and held-out splits apart): the broad corpus thinned evenly
    (every n-th document, so code, pydoc, licences and the Bible all stay in) to the chat corpus's length, then the two
    interleaved line by line.

    Why a second mix: in "mixed" the chat corpus is ~10 % of the characters, and a coder trained on it explains the
    prompts people type worse than one trained on more chat (a layer-6 transcoder at 300k tokens: EV 0.596 on
    hand-written modern prose trained on chat alone, 0.401 on mixed; docs/features.md, "Bundled SAEs"). The bundled
    SAEs, one layer each, can afford the chat-heavy mix; the prepared full sets keep "mixed" (their recorded figures
    and cached scans name its fingerprint)."""
    return _mix(model, "balanced", lambda broad, chat: _interleave(_thin(broad, sum(map(len, chat))), chat), progress)


def _mix(model: Any, kind: str, merge: Callable[[list[str], list[str]], list[str]], progress: ProgressLike = True
         ) -> tuple[Path, Path]:
    """corpus_dir(model, kind)/{train,heldout}.jsonl: merge(broad lines, chat lines) of each split, written once."""
    from .broad import broad_corpus

    folder = corpus_dir(model, kind)
    train, heldout = folder / "train.jsonl", folder / "heldout.jsonl"
    if train.is_file() and heldout.is_file():
        return train, heldout
    chat = chat_corpus(model, progress=progress)
    broad = broad_corpus()
    for out, a, b in ((train, broad[0], chat[0]), (heldout, broad[1], chat[1])):
        _write_lines(out, merge(a.read_text(encoding="utf-8").splitlines(), b.read_text(encoding="utf-8").splitlines()))
    return train, heldout


def _write_lines(out: Path, lines: list[str]) -> None:
    """`lines` into `out`, one a line (written beside, then renamed: _write_text)."""
    _write_text(out, "\n".join(lines) + "\n")


def _write_text(out: Path, text: str) -> None:
    """`text` into `out`, written beside and then renamed: a half-written corpus is never read."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)


QUICK_JOBS = 6  # the quick corpus's training jobs: one seed of each of the six kinds (bench/studies/quick_set_curve.py)


def slice_jobs(n: int, rounds: int = ROUNDS, seeds: list[tuple[str, str]] | None = None
               ) -> list[tuple[int, int, str, str]]:
    """The first `n` of chat_corpus's training jobs (round, seed index, kind, seed; held-out seeds left out) in a
    stratified order: within a round, each job ranks by its seed's place within its kind, (j + 0.5) / (seeds of that
    kind), ties in SEEDS's kind order. Any prefix so holds each kind in about its share (the first 6: one of each),
    and a larger slice holds a smaller one. The jobs keep their own (round, index), so their parts are chat_corpus's
    own: the full corpus later reuses them."""
    seeds = SEEDS if seeds is None else seeds
    kinds = list(dict.fromkeys(kind for kind, _ in seeds))
    count = {kind: sum(1 for k, _ in seeds if k == kind) for kind in kinds}
    place, seen = [], dict.fromkeys(kinds, 0)
    for kind, _ in seeds:
        place.append((seen[kind] + 0.5) / count[kind])
        seen[kind] += 1
    jobs = [job for job in generation_jobs(rounds, seeds) if not held_out(job[3])]
    return sorted(jobs, key=lambda j: (j[0], place[j[1]], kinds.index(j[2])))[:n]


def quick_corpus(model: Any, n: int = QUICK_JOBS, progress: ProgressLike = True
                 ) -> tuple[Path, Path]:
    """The quick replacement model's corpus ("quick"): "mixed" at a fraction of its length and its cost.

    Training split: the chat corpus's first `n` training jobs (slice_jobs) interleaved with the broad corpus's training
    split cut to its first n / (all jobs) of its lines, so chat keeps about "mixed"'s share (the broad corpus was
    shuffled once: a prefix keeps every kind of text). Held-out split: "mixed"'s own, the broad held-out split whole
    with the chat corpus's held-out seeds, so the quick set's feature scan and evaluation read what the full set's
    read. The chat lines are dealt round-robin over the jobs (each job's first sample, then each one's second, ...),
    so a run that reads only a prefix still meets every seed. The parts are the chat corpus's own (generated once,
    shared with the full corpus); written once into corpus_dir(model, "quick") (another `n`: "quick{n}")."""
    from .broad import broad_corpus

    folder = corpus_dir(model, "quick" if n == QUICK_JOBS else f"quick{n}")  # another slice, another folder
    train, heldout = folder / "train.jsonl", folder / "heldout.jsonl"
    if train.is_file() and heldout.is_file():
        return train, heldout
    all_jobs = generation_jobs()
    held = [job for job in all_jobs if held_out(job[3])]
    jobs = slice_jobs(n)
    parts = generate_parts(model, corpus_dir(model) / "parts", jobs + held, progress,
                           desc=f"quick corpus ({model.name})")
    lines = [path.read_text(encoding="utf-8").splitlines() for path in parts]
    chat_train, chat_heldout = _deal(lines[:len(jobs)]), [line for part in lines[len(jobs):] for line in part]
    broad_train, broad_heldout = (path.read_text(encoding="utf-8").splitlines() for path in broad_corpus())
    keep = round(len(broad_train) * n / len(all_jobs))
    _write_lines(train, _interleave(broad_train[:keep], chat_train))
    _write_lines(heldout, _interleave(broad_heldout, chat_heldout))
    return train, heldout


def _deal(parts: list[list[str]]) -> list[str]:
    """The parts' lines dealt round-robin: every part's first line, then every part's second, ..."""
    return [part[i] for i in range(max(map(len, parts), default=0)) for part in parts if i < len(part)]


def _thin(lines: list[str], chars: int) -> list[str]:
    """Every n-th line, n chosen so the kept lines hold about `chars` characters (all of them when they hold fewer)."""
    stride = max(1, round(sum(map(len, lines)) / max(chars, 1)))
    return lines[::stride]


def _interleave(a: list[str], b: list[str]) -> list[str]:
    """a and b merged evenly (each keeps its order): b's lines spread across a's."""
    if not a or not b:
        return a + b
    out, j = [], 0
    for i, line in enumerate(a):
        out.append(line)
        while j < len(b) and (j + 1) * len(a) <= (i + 1) * len(b):
            out.append(b[j])
            j += 1
    out.extend(b[j:])
    return out


def _chat_text(model: Any, user: str) -> str:
    """The user's turn in the model's chat template, ready for the assistant's answer (the template's text)."""
    tok = model.tokenizer
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    return user


@torch.inference_mode()
def sample_continuations(model: Any, prompt: str, samples: int, new_tokens: int, seed: int,
                         stop: threading.Event | None = None) -> list[str]:
    """`samples` sampled continuations of `prompt` decoded together: one [samples, pos] prefill and one
    [samples, 1] step per token through a batched KV cache. Each document is the prompt's text + its continuation,
    cut at the model's end-of-sequence token. `stop`, once set, ends the decoding at the next token (_Stopped)."""
    from ..hooks import build_context
    from ..tokens import decode, eos_id
    from ..variants import resolve_variant

    ids = model.encode(prompt)
    n = min(new_tokens, model.cfg.context_length - len(ids))
    ctx = build_context(model.hook_names, [])
    v = resolve_variant(None, model.cfg)
    cache = model.decoder.new_cache(len(ids) + n, batch=samples)
    g = torch.Generator().manual_seed(seed)
    eos = eos_id(model.tokenizer)
    out = torch.zeros(samples, n, dtype=torch.long)
    done = torch.zeros(samples, dtype=torch.bool)
    step_in = ids[None].expand(samples, -1)
    for t in range(n):
        if stop is not None and stop.is_set():
            raise _Stopped(prompt)
        logits = model.decoder.forward(step_in, ctx, v, cache, last_only=True)[:, -1].float()  # [b, vocab]
        kth = logits.topk(TOP_K, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf")) / TEMPERATURE
        token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)[:, 0]  # [b]
        out[:, t] = token
        if eos is not None:
            done |= token == eos
        if bool(done.all()):
            out = out[:, : t + 1]
            break
        step_in = token[:, None]
    docs = []
    for row in out.tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos)]
        docs.append(prompt + decode(model.tokenizer, row))
    return docs
