"""The methods of the benchmark (runner.py): the model under test and one runner per method.

specref's methods are registry.py's (the same configuration the picker and the CLI build);
transformers' (hf, hf_pld, hf_assist) are wrapped here.

Each runner takes a prompt (1, T), the KV-cache size and a seed, runs one generation and returns a
record of counters (tokens, wall time, target forwards; for specref methods also drafts, accepted
per position and the draft / verify / prefill times of generate.py's GenerationStats).
transformers' methods count target forwards with a forward hook (their first forward is the prefill,
which emits the first token). The trained draft (draft_model.load_trained_draft) has a reduced vocabulary (Vd
rows in its LM head, token_map to target ids); for transformers' assisted generation it is wrapped
so its head scatters the Vd logits into the full V with -inf elsewhere: the same draft, so q is 0
outside the map in both. EAGLE runs the committed EAGLE-1 head (eagle_head.py) as a chain; Medusa
the committed heads (medusa_heads.py) over the tree their file ships, with lossless acceptance
(`medusa`) or Medusa's typical acceptance (`medusa_typical`, lossy at T > 0, equal to `medusa` at
T = 0); Hydra (`hydra`, `hybrid_hydra`) the committed sequentially dependent heads of the same
file format over their tree; `hf_static` is transformers' generate with its static cache (which it compiles itself on
CUDA: the baseline a compiled specref `ar` must match); MTP the committed modules (mtp.py) as a
chain of k = max(D, 3); the MLP speculator (mlp_speculator.py) its committed stages as a chain of
k = n_predict, alone or behind prompt lookup (`hybrid_mlp_speculator`); EAGLE-2 (`eagle2`, eagle_tree.py) the same EAGLE-1 head growing a dynamic
tree, alone or behind prompt lookup (`hybrid_eagle2`), or with siblings sampled without replacement
(`eagle2_sampled`, eagle_sampled.py: the tree traversal verification covers); EAGLE-3 (`eagle3`, `eagle3_tree`,
`hybrid_eagle3`, eagle3.py) the committed EAGLE-3 head as a chain, a dynamic tree, or behind
prompt lookup. SuffixDecoding (`suffix`, `suffix_tree`, `hybrid_suffix`, suffix.py) keeps one global
tree per method for the whole run (registry.py): the runner empties it after the warm-up (and the
picker's calibration), so it starts cold and sees the timed questions in file order. `ar_fp32` (only with a bf16/fp16
model) is `ar` on a float32 copy of the same model, so one run gives a low-precision method's
ratio to float32 decoding and the fraction of questions whose greedy output is unchanged.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ..target import device_sync
from ..target import Target

EXTRA_METHODS = ("auto",)  # accepted by --methods, never run by default (auto calibrates first)
ALL_METHODS = ("ar", "ar_fp32", "hf", "hf_static", "ngram", "lookahead", "draft", "eagle", "eagle2",
               "eagle2_sampled", "eagle3", "eagle3_tree", "hybrid", "hybrid_tree", "hybrid_draft", "hybrid_eagle2",
               "hybrid_eagle3", "medusa", "medusa_typical", "hybrid_medusa", "hydra", "hybrid_hydra", "mtp",
               "mlp_speculator", "hybrid_mlp_speculator", "suffix", "suffix_tree", "hybrid_suffix", "hf_pld", "hf_assist")


def load_model(cfg):
    """(model, encode(text or messages) -> chat-template token ids, eos id(s) or None, model name); cfg.attn, if
    set, is the model's attention implementation (every layer reads config._attn_implementation)."""
    model, encode, eos, name = _load_model(cfg)
    if getattr(cfg, "attn", None):
        model.set_attn_implementation(cfg.attn)
    return model, encode, eos, name


def _load_model(cfg):
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.dtype)
    if dtype is None:
        raise ValueError(f"dtype {cfg.dtype!r} is not one of float32, bfloat16, float16")
    if cfg.model == "tiny":  # test-only: a seeded random Llama and a byte "tokenizer"
        from ..models import tiny_model

        V = 96
        model = tiny_model("llama", vocab_size=V, init_std=0.2, logit_scale=2.0, dtype=dtype).to(cfg.device)

        def tiny_encode(text) -> List[int]:  # a user turn, or chat messages: each turn's first 40 bytes
            parts = [text] if isinstance(text, str) else [m["content"] for m in text]
            return [t for part in parts for t in [1] + [2 + b % (V - 2) for b in part.encode()[:40]]]
        return model, tiny_encode, None, "tiny random Llama"
    if cfg.model == "default":
        from ..models import load_default

        model, tok = load_default(dtype=dtype, device=cfg.device)
        name = "SmolLM2-135M-Instruct (embedded GGUF, dequantised)"
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not Path(cfg.model).is_dir():
            raise ValueError(f"model {cfg.model!r} is not 'default', 'tiny' or a local model folder")
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype, local_files_only=True)
        model = model.to(cfg.device).eval()
        tok = AutoTokenizer.from_pretrained(cfg.model, local_files_only=True)
        name = Path(cfg.model).name  # a folder by its name, not a path of this machine

    def encode(text) -> List[int]:  # a user turn, or chat messages (a second turn: workloads.second_turns)
        msgs = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)
        out = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"])

    eos = model.generation_config.eos_token_id
    eos = tok.eos_token_id if eos is None else eos
    return model, encode, (eos[0] if isinstance(eos, list) and len(eos) == 1 else eos), name


class _FullVocabHead(torch.nn.Module):
    """A reduced LM head (Vd rows) seen as a full one: logits scattered into V, -inf-like elsewhere,
    so transformers' assisted generation can use a reduced-vocabulary draft as `assistant_model`."""

    def __init__(self, head: torch.nn.Module, token_map: torch.Tensor, vocab_size: int):
        super().__init__()
        self.head, self.vocab_size = head, vocab_size
        self.register_buffer("token_map", token_map.long(), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        small = self.head(h)  # (B, T, Vd)
        full = small.new_full((*small.shape[:-1], self.vocab_size), torch.finfo(small.dtype).min)  # (B, T, V)
        return full.index_copy_(-1, self.token_map, small)  # (B, T, V)


def _as_assistant(draft, token_map, vocab_size: int, k: int):
    """A shallow copy of the draft whose head covers the full vocabulary (weights shared)."""
    a = copy.copy(draft)
    a._modules = dict(draft._modules)
    a.lm_head = _FullVocabHead(draft.lm_head, token_map, vocab_size)
    a.config = copy.deepcopy(draft.config)
    a.config.vocab_size = vocab_size
    a.generation_config = copy.deepcopy(draft.generation_config)
    a.generation_config.num_assistant_tokens = k  # the same k as specref's draft method
    a.generation_config.num_assistant_tokens_schedule = "constant"
    return a


@dataclass
class Method:
    name: str
    label: str
    run: Callable  # (ids (B, T), max_len, seed, n=max_new_tokens, mask=None (B, T)) -> record dict
    k: Optional[int] = None
    specref: bool = True
    queue: Optional[Callable] = None  # specref's: (prompts, B, max_len, seed, refill) -> record dict of
    # scheduler.schedule() over every prompt with B rows (refill "row" or "batch")
    prepare: Optional[Callable] = None  # (prompts: lists of ids) -> None, before any run: the workload
    # `auto` calibrates on


def _spec_record(out) -> dict:
    """tokens: row 0's (batch 1); rows: every row's; idle: row-steps spent on finished rows."""
    s = out.stats
    B = out.tokens.shape[0]
    return dict(tokens=out.row(0), rows=[out.row(b) for b in range(B)], wall=s.wall_time,
                idle=1.0 - s.num_row_steps / max(s.target_forwards * B, 1), forwards=s.num_row_steps, drafts=s.num_drafts,
                drafted=s.num_draft_tokens, accepted=s.num_accepted_tokens,
                acc_pos=list(s.accepted_per_position), drafted_pos=list(s.drafted_per_position),
                draft_time=s.draft_time, verify_time=s.verify_time, prefill_time=s.prefill_time,
                ttft=s.first_token_time, tpot=list(s.time_per_output_token))


def _queue_record(out) -> dict:
    """A scheduler run: rows in request order, per-request TTFT (the queue's wait included) and TPOT,
    and the row-steps with no request while requests waited (idle) or none waited (finished)."""
    s = out.stats
    total = max(s.num_row_steps + s.idle_row_steps + s.finished_row_steps, 1)
    return dict(rows=out.tokens, wall=s.wall_time, prefill_time=s.prefill_time, ttft=list(s.row_first_token),
                tpot=list(s.time_per_output_token), idle=s.idle_row_steps / total,
                finished=s.finished_row_steps / total, forwards=s.target_forwards)


def build_methods(cfg, model, eos, target, registry=None) -> tuple:
    """(methods in run order, {skipped name: reason}). specref's methods are registry.py's, built
    for this model (cfg.model "default": the committed weights; "tiny": untrained ones)."""
    from ..generate import autoregressive_generate, speculative_generate
    from ..registry import LEARNED, METHODS, Registry, verify_rules

    N, T, dev = cfg.max_new_tokens, cfg.temperature, model.device
    V = int(model.get_output_embeddings().weight.shape[0])
    gen = dict(max_new_tokens=N, temperature=T, eos_token_id=eos, timing=True)  # phase times exact on GPUs
    eos_ids = set() if eos is None else set([eos] if isinstance(eos, int) else eos)
    reg = registry or Registry(model, target, kind="tiny" if cfg.model == "tiny" else "default" if cfg.model == "default"
                   else "custom", draft_k=cfg.draft_k, lookahead=cfg.lookahead)
    methods: List[Method] = []
    skipped: Dict[str, str] = {}

    def spec(name):  # cfg.verify where the method takes it (registry.verify_rules), else token-wise
        rule = cfg.verify if cfg.verify in verify_rules(name) else "tokenwise"
        return lambda ids, max_len, seed, n=N, mask=None: _spec_record(speculative_generate(
            target, reg.proposer(name), ids, mask, seed=seed, max_len=max_len, verify=rule,
            **{**gen, "max_new_tokens": n}))

    def queue(name):
        from ..generate import NullProposer
        from ..scheduler import schedule

        return lambda prompts, B, max_len, seed, refill: _queue_record(schedule(
            target, NullProposer() if name == "ar" else reg.proposer(name), prompts, batch_size=B, seed=seed,
            max_len=max_len, refill=refill, **gen))

    def hf(extra, counter):
        def run(ids, max_len, seed, n=N, mask=None):
            torch.manual_seed(seed)
            sample = dict(do_sample=True, temperature=T, top_k=0, top_p=1.0) if T > 0 else dict(do_sample=False)
            hook = model.register_forward_hook(lambda *a: counter.__setitem__(0, counter[0] + 1))
            counter[0] = 0
            try:
                t0 = time.perf_counter()
                am = torch.ones_like(ids) if mask is None else mask  # (B, T) left padding for B > 1
                seq = model.generate(ids, attention_mask=am, max_new_tokens=n,
                                     eos_token_id=eos, pad_token_id=min(eos_ids, default=0), **sample, **extra)
                device_sync(dev)
                wall = time.perf_counter() - t0
            finally:
                hook.remove()
            rows = []
            for toks in seq[:, ids.shape[1]:].tolist():
                stops = [i for i, t in enumerate(toks) if t in eos_ids]
                rows.append(toks[: stops[0] + 1] if stops else toks)  # up to the row's first eos
            return dict(tokens=rows[0], rows=rows, wall=wall, forwards=counter[0])
        return run

    for name in cfg.methods:
        if name == "ar":
            continue  # always first, added below
        if name == "ar_fp32":  # the same model in float32: a low-precision run's ratio to fp32
            if cfg.dtype == "float32":
                skipped[name] = "the model is float32 already: ar is this baseline"
                continue
            fp32, _, _, _ = load_model(replace(cfg, dtype="float32", attn=None))  # as loaded: the usual fp32
            t32 = Target(fp32, target.config)
            methods.append(Method("ar_fp32", "specref autoregressive, float32 model", lambda ids, max_len, seed, n=N,
                                  mask=None, t32=t32: _spec_record(autoregressive_generate(
                                      t32, ids, mask, seed=seed, max_len=max_len, **{**gen, "max_new_tokens": n})),
                                  specref=False))  # its greedy output may differ from the low-precision ar's
            continue
        if name == "hf":
            methods.append(Method("hf", "transformers generate", hf({}, [0]), specref=False))
        elif name == "hf_static":  # transformers compiles the forward itself with a static cache on CUDA
            methods.append(Method("hf_static", "transformers generate, static cache" + (
                " (auto-compiled)" if dev.type == "cuda" else ""), hf({"cache_implementation": "static"}, [0]),
                specref=False))
        elif name == "hf_pld":
            methods.append(Method("hf_pld", "transformers prompt lookup (10)",
                                  hf({"prompt_lookup_num_tokens": 10}, [0]), k=10, specref=False))
        elif name == "hf_assist":
            try:
                draft, token_map, k = reg.trained_draft()
            except (ImportError, ValueError, FileNotFoundError) as e:
                skipped[name] = f"no trained draft ({e})"
                continue
            assistant = _as_assistant(draft, token_map, V, k)
            methods.append(Method("hf_assist", f"transformers assisted, trained draft (k={k})",
                                  hf({"assistant_model": assistant}, [0]), k=k, specref=False))
        elif name == "auto":
            methods.append(_auto_method(cfg, reg, target, gen, [m for m in cfg.methods if m in METHODS and m != "ar"]))
        elif name in METHODS:
            try:
                label, k = reg.label(name), reg.proposer(name).k
            except (ImportError, ValueError, FileNotFoundError) as e:
                skipped[name] = f"no trained {LEARNED.get(name, name)} ({e})"
                continue
            methods.append(Method(name, label, spec(name), k=k, queue=queue(name)))
        else:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(ALL_METHODS)}")
    base = Method("ar", "specref autoregressive (baseline)", lambda ids, max_len, seed, n=N, mask=None: _spec_record(
        autoregressive_generate(target, ids, mask, seed=seed, max_len=max_len, **{**gen, "max_new_tokens": n})),
        queue=queue("ar"))
    return [base] + methods, skipped


def _auto_method(cfg, reg, target, gen, candidates: List[str]) -> Method:
    """`auto` (picker/auto.py): at each batch size B, calibrated once on the prepared prompts (else on
    the first run's rows) with the other specref methods named as candidates (none: every lossless
    method), then the pick with k per step from the costs at B. Each record names the pick."""
    from ..generate import autoregressive_generate, speculative_generate
    from ..picker.auto import AutoConfig, build_auto
    from ..scheduler import schedule

    built: Dict[int, object] = {}
    workload: List[List[int]] = []

    def get(B: int, rows: List[List[int]]):
        if B not in built:
            conf = AutoConfig(batch_size=B, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                              methods=tuple(candidates) or None)
            built[B] = build_auto(reg.model, workload or rows, conf, reg)
        return built[B]

    def unpadded(ids, mask) -> List[List[int]]:
        return [r[m.bool()].tolist() if m is not None else r.tolist()
                for r, m in zip(ids.cpu(), [None] * len(ids) if mask is None else mask.cpu())]

    def run(ids, max_len, seed, n=cfg.max_new_tokens, mask=None):
        a = get(ids.shape[0], unpadded(ids, mask))
        p = a.fresh(reg)
        out = (autoregressive_generate(target, ids, mask, seed=seed, max_len=max_len, **{**gen, "max_new_tokens": n})
               if p is None else speculative_generate(target, p, ids, mask, seed=seed, max_len=max_len,
                                                      **{**gen, "max_new_tokens": n}))
        return dict(_spec_record(out), pick=a.method)

    def queue(prompts, B, max_len, seed, refill):
        from ..generate import NullProposer

        a = get(B, [list(p) for p in prompts[:B]])
        p = a.fresh(reg)
        out = schedule(target, NullProposer() if p is None else p, prompts, batch_size=B, seed=seed, max_len=max_len,
                       refill=refill, **gen)
        return dict(_queue_record(out), pick=a.method)

    ks = []
    for m in list(candidates):  # the candidates this model has (a learned method may have no weights)
        try:
            ks.append(reg.proposer(m).k)
        except (ImportError, ValueError, FileNotFoundError):
            candidates.remove(m)
    label = ("specref auto (the picker's pick at each B among " + (", ".join(candidates) or "every method")
             + "; k per step from the costs at B)")
    return Method("auto", label, run, k=max(ks + [10]), queue=queue,
                  prepare=lambda prompts: workload.extend(list(p) for p in prompts))
