"""The methods of the benchmark (runner.py): the model under test and one runner per method.

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
T = 0); MTP the committed modules (mtp.py) as a chain of k = max(D, 3). Left out: EAGLE-2 trees.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ..costs import device_sync

ALL_METHODS = ("ar", "hf", "ngram", "lookahead", "draft", "eagle", "hybrid", "hybrid_tree", "hybrid_draft",
               "medusa", "medusa_typical", "hybrid_medusa", "mtp", "hf_pld", "hf_assist")


def load_model(cfg):
    """(model, encode(text) -> chat-template token ids, eos id(s) or None, model name)."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.dtype)
    if dtype is None:
        raise ValueError(f"dtype {cfg.dtype!r} is not one of float32, bfloat16, float16")
    if cfg.model == "tiny":  # test-only: a seeded random Llama and a byte "tokenizer"
        from ..models import tiny_model

        V = 96
        model = tiny_model("llama", vocab_size=V, init_std=0.2, logit_scale=2.0, dtype=dtype).to(cfg.device)
        return model, (lambda text: [1] + [2 + b % (V - 2) for b in text.encode()[:40]]), None, "tiny random Llama"
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
        name = cfg.model

    def encode(text: str) -> List[int]:
        out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)
        return list(out["input_ids"])

    eos = model.generation_config.eos_token_id
    eos = tok.eos_token_id if eos is None else eos
    return model, encode, (eos[0] if isinstance(eos, list) and len(eos) == 1 else eos), name


def _trained_draft(cfg, model):
    """(draft, token_map, alpha or None) or raise ValueError/ImportError when there is none."""
    if cfg.model == "tiny":  # an untrained reduced-vocabulary draft: exercises the code path only
        from ..draft_model import build_draft

        return build_draft(model, 1, torch.arange(0, model.config.vocab_size, 2)), \
            torch.arange(0, model.config.vocab_size, 2, device=model.device), None
    if cfg.model != "default":
        raise ValueError("the trained draft belongs to the default model")
    from ..draft_model import load_trained_draft, trained_draft_info

    draft, token_map = load_trained_draft(model)
    alpha = trained_draft_info().get("record", {}).get("heldout", {}).get("heldout_top1")
    return draft, token_map, alpha


def _eagle_head(cfg, model):
    """(EagleHead, alpha or None) or raise ValueError when there is none."""
    from ..eagle_head import WEIGHTS, EagleHead, eagle_info, load_eagle

    if cfg.model == "tiny":  # an untrained head: exercises the code path only
        return EagleHead(model, torch.arange(0, model.config.vocab_size, 2)), None
    if cfg.model != "default":
        raise ValueError("the trained EAGLE head belongs to the default model")
    return load_eagle(model, WEIGHTS), eagle_info(WEIGHTS)["record"].get("heldout", {}).get("heldout_top1")


def _mtp_stack(cfg, model):
    """(the committed MTP modules, k) (untrained ones for the tiny test model); ValueError when none."""
    from ..mtp import WEIGHTS, MTPStack, load_mtp

    if cfg.model == "tiny":  # an untrained module: exercises the code path only
        stack = MTPStack(model, torch.arange(0, model.config.vocab_size, 2))
    elif cfg.model != "default":
        raise ValueError("the trained MTP modules belong to the default model")
    else:
        stack = load_mtp(model, WEIGHTS)
    return stack, cfg.draft_k or max(stack.num_modules, 3)


def _medusa_heads(cfg, model):
    """The committed Medusa heads (untrained ones for the tiny test model)."""
    from ..medusa_heads import WEIGHTS, MedusaHeads, load_medusa

    if cfg.model == "tiny":  # untrained heads: exercises the code path only
        return MedusaHeads(model, 3, torch.arange(0, model.config.vocab_size, 2))
    if cfg.model != "default":
        raise ValueError("the trained Medusa heads belong to the default model")
    return load_medusa(model, WEIGHTS)


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


def _spec_record(out) -> dict:
    """tokens: row 0's (batch 1); rows: every row's; idle: row-steps spent on finished rows."""
    s = out.stats
    B = out.tokens.shape[0]
    return dict(tokens=out.row(0), rows=[out.row(b) for b in range(B)], wall=s.wall_time,
                idle=1.0 - s.num_row_steps / max(s.target_forwards * B, 1), forwards=s.num_row_steps, drafts=s.num_drafts,
                drafted=s.num_draft_tokens, accepted=s.num_accepted_tokens,
                acc_pos=list(s.accepted_per_position), drafted_pos=list(s.drafted_per_position),
                draft_time=s.draft_time, verify_time=s.verify_time, prefill_time=s.prefill_time)


def build_methods(cfg, model, eos, target) -> tuple:
    """(methods in run order, {skipped name: reason})."""
    from ..generate import autoregressive_generate, speculative_generate
    from ..hybrid import HybridConfig, HybridProposer
    from ..ngram import NgramConfig, NgramProposer

    N, T, dev = cfg.max_new_tokens, cfg.temperature, model.device
    V = int(model.get_output_embeddings().weight.shape[0])
    gen = dict(max_new_tokens=N, temperature=T, eos_token_id=eos, timing=True)  # phase times exact on GPUs
    eos_ids = set() if eos is None else set([eos] if isinstance(eos, int) else eos)
    methods: List[Method] = []
    skipped: Dict[str, str] = {}
    trained: dict = {}  # loaded once for "draft", "hf_assist" and "hybrid_draft"
    eagle: dict = {}  # loaded once for "eagle" and "hybrid"
    medusa: dict = {}  # the heads, loaded once for the three Medusa methods
    ngram: list = []  # the n-gram settings, measured once

    def ngram_config() -> NgramConfig:
        if not ngram:
            from ..costs import measure_verify_cost

            vc = measure_verify_cost(target, 10)  # the draft length rule needs this machine's costs
            ngram.append(NgramConfig(k=10, adaptive=True, draft_cost=round(vc["c"], 4),
                                     verify_cost_fixed=round(vc["c0"], 4)))
        return ngram[0]

    def spec(make_proposer):
        return lambda ids, max_len, seed, n=N, mask=None: _spec_record(speculative_generate(
            target, make_proposer(), ids, mask, seed=seed, max_len=max_len, **{**gen, "max_new_tokens": n}))

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
        if name == "hf":
            methods.append(Method("hf", "transformers generate", hf({}, [0]), specref=False))
        elif name == "ngram":
            ng = ngram_config()
            methods.append(Method("ngram", f"specref n-gram (adaptive, k<=10; c {ng.draft_cost:.3f}, "
                                  f"c0 {ng.verify_cost_fixed:.3f})", spec(lambda: NgramProposer(ng)), k=ng.k))
        elif name == "lookahead":
            try:
                from ..lookahead import LookaheadConfig, LookaheadProposer
            except ImportError as e:
                skipped[name] = f"specref.lookahead not importable ({e})"
                continue
            W, Nn, G = cfg.lookahead
            la = LookaheadConfig(W=W, N=Nn, G=G)
            methods.append(Method("lookahead", f"specref lookahead (W {W}, N {Nn}, G {G})",
                                  spec(lambda: LookaheadProposer(la)), k=LookaheadProposer(la).k))
        elif name in ("draft", "hf_assist", "hybrid_draft"):
            try:
                if not trained:
                    draft, token_map, alpha = _trained_draft(cfg, model)
                    trained.update(draft=draft, token_map=token_map,
                                   k=cfg.draft_k or _draft_k(target, draft, alpha))
            except (ImportError, ValueError, FileNotFoundError) as e:
                skipped[name] = f"no trained draft ({e})"
                continue
            draft, token_map, k = trained["draft"], trained["token_map"], trained["k"]
            if name in ("draft", "hybrid_draft"):
                from ..draft_model import DraftModelConfig, DraftModelProposer

                dk = DraftModelConfig(k=k)
                make = lambda: DraftModelProposer(draft, dk, token_map=token_map, vocab_size=V)  # noqa: E731
                if name == "draft":
                    methods.append(Method("draft", f"specref trained draft (k={k})", spec(make), k=k))
                else:
                    ng = ngram_config()
                    methods.append(Method("hybrid_draft", f"specref n-gram, else trained draft (k={k}; {_costs(ng)})",
                                          spec(lambda: HybridProposer(NgramProposer(ng), make())), k=max(k, ng.k)))
            else:
                assistant = _as_assistant(draft, token_map, V, k)
                methods.append(Method("hf_assist", f"transformers assisted, trained draft (k={k})",
                                      hf({"assistant_model": assistant}, [0]), k=k, specref=False))
        elif name in ("eagle", "hybrid", "hybrid_tree"):
            try:
                if not eagle:
                    eagle.update(_eagle_setup(cfg, model, target))
            except (ImportError, ValueError, FileNotFoundError) as e:
                skipped[name] = f"no trained EAGLE head ({e})"
                continue
            from ..eagle_head import EagleProposer

            head, ec = eagle["head"], eagle["config"]
            if name == "eagle":
                methods.append(Method("eagle", f"specref EAGLE-1 head (adaptive, k<={ec.k}; c {ec.draft_cost:.3f}, "
                                      f"c0 {ec.verify_cost_fixed:.3f})", spec(lambda: EagleProposer(head, ec)), k=ec.k))
            elif name == "hybrid":
                ng = ngram_config()
                methods.append(Method("hybrid", f"specref n-gram, else EAGLE-1 head (adaptive, k<={ec.k}; "
                                      f"{_costs(ng)} / {_costs(ec)})",
                                      spec(lambda: HybridProposer(NgramProposer(ng), EagleProposer(head, ec))),
                                      k=max(ec.k, ng.k)))
            else:
                ng, tree = ngram_config(), HybridConfig(mode="tree")
                methods.append(Method("hybrid_tree", f"specref n-gram and EAGLE-1 head as a 2-branch tree "
                                      f"(k<={ec.k}; {_costs(ng)} / {_costs(ec)})",
                                      spec(lambda: HybridProposer(NgramProposer(ng), EagleProposer(head, ec), tree)),
                                      k=ec.k + ng.k))
        elif name in ("medusa", "medusa_typical", "hybrid_medusa"):
            try:
                if "heads" not in medusa:
                    medusa["heads"] = _medusa_heads(cfg, model)
                heads = medusa["heads"]
            except (ImportError, ValueError, FileNotFoundError) as e:
                skipped[name] = f"no trained Medusa heads ({e})"
                continue
            from ..medusa_heads import MedusaConfig, MedusaProposer

            mc = MedusaConfig(acceptance="typical" if name == "medusa_typical" else "lossless")
            n_nodes = MedusaProposer(heads, mc).k
            label = "typical acceptance, LOSSY at T > 0" if name == "medusa_typical" else "lossless"
            if name == "hybrid_medusa":
                ng = ngram_config()
                methods.append(Method(name, f"specref n-gram, else Medusa heads ({n_nodes}-node tree; {_costs(ng)})",
                                      spec(lambda h=heads, m=mc: HybridProposer(NgramProposer(ng), MedusaProposer(h, m))),
                                      k=max(n_nodes, ng.k)))
                continue
            methods.append(Method(name, f"specref Medusa heads ({heads.num_heads} heads, {n_nodes}-node tree; {label})",
                                  spec(lambda h=heads, m=mc: MedusaProposer(h, m)), k=n_nodes))
        elif name == "mtp":
            try:
                stack, mk = _mtp_stack(cfg, model)
            except (ImportError, ValueError, FileNotFoundError) as e:
                skipped[name] = f"no trained MTP modules ({e})"
                continue
            from ..mtp import MTPConfig, MTPProposer

            mtp_cfg = MTPConfig(k=mk)
            methods.append(Method("mtp", f"specref MTP modules (D={stack.num_modules}, k={mk}; module D reused after)",
                                  spec(lambda s=stack, c=mtp_cfg: MTPProposer(s, c)), k=mk))
        elif name == "hf_pld":
            methods.append(Method("hf_pld", "transformers prompt lookup (10)",
                                  hf({"prompt_lookup_num_tokens": 10}, [0]), k=10, specref=False))
        else:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(ALL_METHODS)}")
    base = Method("ar", "specref autoregressive (baseline)", lambda ids, max_len, seed, n=N, mask=None: _spec_record(
        autoregressive_generate(target, ids, mask, seed=seed, max_len=max_len, **{**gen, "max_new_tokens": n})))
    return [base] + methods, skipped


def _costs(c) -> str:
    """The measured costs an adaptive config decides with, for a method's label."""
    return f"c {c.draft_cost:.3f}, c0 {c.verify_cost_fixed:.3f}"


def _eagle_setup(cfg, model, target) -> dict:
    """The committed head and its adaptive EagleConfig: k by the closed form from the held-out alpha
    and the measured head cost; per row and step k' <= k by the same closed form on the row's
    measured acceptance, with this machine's costs (a head step plus one more verified token, c0)."""
    from ..costs import measure_verify_cost
    from ..eagle_head import EagleConfig, measure_head_cost
    from ..theory import optimal_k

    head, alpha = _eagle_head(cfg, model)
    c_head = measure_head_cost(target, head)["c"]
    ek = cfg.draft_k or (4 if alpha is None else optimal_k(float(alpha), c_head, k_max=10))
    vc = measure_verify_cost(target, ek)
    return dict(head=head, config=EagleConfig(k=ek, adaptive=True, draft_cost=round(c_head + vc["c"], 4),
                                              verify_cost_fixed=round(vc["c0"], 4)))


def _draft_k(target, draft, alpha) -> int:
    """k from the closed form (theory.optimal_k) with the draft's held-out alpha and measured c."""
    from ..costs import measure_cost
    from ..theory import optimal_k

    if alpha is None:
        return 4
    return optimal_k(float(alpha), measure_cost(target, draft)["c"], k_max=10)

