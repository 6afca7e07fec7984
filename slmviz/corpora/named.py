"""Training corpora by name: what `train_sae` / `train_transcoders` take as `corpus="broad"` or `corpus="chat"`.

- "broad": the bundled offline corpus of code, pydoc, READMEs, licences and the King James Bible
  (corpora.broad.broad_corpus), its training split.
- "chat": text the model itself writes, in batches, from varied seeds of the kind people type (news, facts,
  dialogue, questions, chat turns) (features.generated_corpus), its training split. SmolLM2 is an instruct model and
  the broad corpus has no modern prose and no chat turns; coders trained on it explain the prompts users type worse.
- "mixed": both, interleaved (what the prepared full sets train on; chat is ~10 % of it).
- "balanced": half broad (thinned evenly), half chat, interleaved (what the bundled SAEs train on).
- "quick": "mixed" cut short, from six of the chat corpus's seeds (what the quick replacement model trains on;
  corpora.generated.quick_corpus); its held-out split is "mixed"'s.
A path or a list of strings is returned as it is.
"""

from __future__ import annotations

from typing import Any

from ..progress import ProgressLike

NAMES = ("broad", "chat", "mixed", "balanced", "quick")
MODEL_WRITTEN = ("chat", "mixed", "balanced", "quick")  # need the model's chat text (corpora.generated) first


def resolve_corpus(corpus: Any, model: Any = None, split: str = "train", progress: ProgressLike = True) -> Any:
    """A corpus name -> the path of its `split` ("train" | "heldout"); anything else unchanged. `progress`
    (slmviz.progress's contract) reports the writing of a corpus the model writes itself, the first time."""
    if not isinstance(corpus, str) or corpus not in NAMES:
        return corpus
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if corpus == "broad":
        from .broad import broad_corpus

        train, heldout = broad_corpus()
        return train if split == "train" else heldout
    from .generated import balanced_corpus, chat_corpus, chat_heldout, mixed_corpus, quick_corpus

    if model is None:
        raise ValueError(f"corpus={corpus!r} is text a model writes: pass the model (it is generated once per model "
                         "and cached)")
    if corpus == "chat" and split == "heldout":
        return chat_heldout(model, progress=progress)  # without writing the training text first
    make = {"chat": chat_corpus, "mixed": mixed_corpus, "balanced": balanced_corpus, "quick": quick_corpus}
    paths = make[corpus](model, progress=progress)
    return paths[0] if split == "train" else paths[1]
