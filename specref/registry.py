"""Every method of the library by name: one place that turns "eagle" into a ready proposer.

The bench (bench/methods.py), the picker (picker/) and `python -m specref generate --method NAME`
all build their proposers here, so that a method means the same configuration everywhere: the
adaptive rules get this machine's measured costs (costs.measure_verify_cost, the heads' measured
cost), k comes from the closed form (theory.optimal_k) on the trained proposer's held-out alpha, and
the learned proposers load their committed weights (the default model), untrained ones (kind
"tiny", test models: the code path only) or the files a user names (`weights={"eagle": path}`).
Weights and measured costs are loaded and timed once per Registry.

    reg = Registry(model)              # the default model: every method
    proposer = reg.proposer("hybrid")  # None for "ar" (plain autoregressive decoding)
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .target import Target

# name -> what it runs (the order is the bench's and the picker's)
METHODS: Dict[str, str] = {
    "ar": "no speculation: autoregressive_generate",
    "ngram": "prompt lookup (n-gram, adaptive k <= 10)",
    "lookahead": "lookahead decoding (W, N, G)",
    "draft": "the trained reduced-vocabulary draft model (k by the closed form)",
    "eagle": "EAGLE-1 head, chain (adaptive k)",
    "eagle2": "EAGLE-2 dynamic tree from the EAGLE-1 head",
    "eagle2_sampled": "EAGLE-2 tree from the EAGLE-1 head, siblings sampled without replacement (traversal)",
    "eagle3": "EAGLE-3 head (fused features, training-time test), chain (adaptive k)",
    "eagle3_tree": "EAGLE-3 head, EAGLE-2 dynamic tree",
    "hybrid": "prompt lookup where it matches, else the EAGLE-1 head",
    "hybrid_tree": "prompt lookup and the EAGLE-1 head as two branches of one tree",
    "hybrid_draft": "prompt lookup where it matches, else the trained draft",
    "hybrid_eagle2": "prompt lookup where it matches, else the EAGLE-2 dynamic tree",
    "hybrid_eagle3": "prompt lookup where it matches, else the EAGLE-3 head's chain",
    "medusa": "Medusa heads over their shipped tree, lossless acceptance",
    "medusa_typical": "Medusa heads with typical acceptance (LOSSY at T > 0)",
    "hybrid_medusa": "prompt lookup where it matches, else the Medusa heads' tree",
    "hydra": "Hydra's sequentially dependent heads over their shipped tree, lossless acceptance",
    "hybrid_hydra": "prompt lookup where it matches, else the Hydra heads' tree",
    "mtp": "multi-token prediction modules, chain",
    "mlp_speculator": "MLP speculator (Wertheimer et al. 2024), chain of its n stages",
    "hybrid_mlp_speculator": "prompt lookup where it matches, else the MLP speculator's chain",
    "suffix": "SuffixDecoding: suffix trees over the prompt and earlier outputs, one path (k <= 10)",
    "suffix_tree": "SuffixDecoding's speculation tree (k <= 10 nodes)",
    "hybrid_suffix": "SuffixDecoding where its score reaches the EAGLE-1 head's k, else the head",
}
LEARNED = {"draft": "draft", "hybrid_draft": "draft", "eagle": "eagle", "hybrid": "eagle", "hybrid_tree": "eagle",
           "eagle2": "eagle", "eagle2_sampled": "eagle", "hybrid_eagle2": "eagle", "eagle3": "eagle3",
           "eagle3_tree": "eagle3",
           "hybrid_eagle3": "eagle3", "medusa": "medusa", "medusa_typical": "medusa", "hybrid_medusa": "medusa",
           "hydra": "hydra", "hybrid_hydra": "hydra", "mtp": "mtp",
           "mlp_speculator": "mlp_speculator", "hybrid_mlp_speculator": "mlp_speculator", "hybrid_suffix": "eagle"}


# methods that draft token trees (the rest: chains, or nothing)
TREES = {"eagle2", "eagle2_sampled", "eagle3_tree", "hybrid_tree", "hybrid_eagle2", "medusa", "medusa_typical",
         "hybrid_medusa", "hydra", "hybrid_hydra", "lookahead"}


def verify_rules(name: str) -> Tuple[str, ...]:
    """The rules of speculative_generate(verify=...) a method takes (prepare.VERIFY_RULES). Token-wise:
    every one. "block" (Sun et al.): the chain methods (a deterministic chain, q None, is verified
    token-wise under it: block verification gains nothing there). "traversal" (Weng et al.): trees of
    siblings drawn without replacement, eagle2_sampled's (the other trees draft top-k siblings, or an
    n-gram and a head's draw side by side). "ar" and the lossy typical acceptance: token-wise only."""
    check_method(name)
    if name == "eagle2_sampled":
        return ("tokenwise", "traversal")
    if name in ("ar", "medusa_typical") or name in TREES:
        return ("tokenwise",)
    return ("tokenwise", "block")


def check_method(name: str) -> str:
    """name, or ValueError listing the valid ones."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(METHODS)}")
    return name


WEIGHT_KINDS = ("draft", "eagle", "eagle3", "medusa", "hydra", "mtp", "mlp_speculator")  # learned proposers: weight files


def weights_item(s: str) -> tuple:
    """argparse type of `--weights KIND=PATH`: KIND one of WEIGHT_KINDS, PATH an existing file (or
    a published head's folder: eagle, eagle3, medusa; specref/published/)."""
    import argparse
    import os

    kind, eq, path = s.partition("=")
    if not eq or kind not in WEIGHT_KINDS or not path:
        raise argparse.ArgumentTypeError(f"expected KIND=PATH with KIND one of {', '.join(WEIGHT_KINDS)}, got {s!r}")
    if not os.path.exists(path):
        raise argparse.ArgumentTypeError(f"{kind} weights file {path!r} does not exist")
    return kind, path


class Registry:
    """Builds each method's proposer for one target; weights loaded and costs measured once.

    kind: "default" (the embedded default model: the committed weights), "tiny" (test models:
    untrained heads, the code path only) or "custom" (learned methods need `weights[proposer]`, a
    file that `python -m specref train` wrote for this model). draft_k: the trained draft's k and
    the EAGLE head's upper bound (None: the closed form). lookahead: (W, N, G). cost_reps: timed
    repetitions per width of the cost measurements (fewer: faster, noisier)."""

    def __init__(self, model: torch.nn.Module, target: Optional[Target] = None, kind: str = "default",
                 draft_k: Optional[int] = None, lookahead: Tuple[int, int, int] = (7, 5, 7),
                 weights: Optional[Dict[str, str]] = None, cost_reps: int = 9):
        if kind not in ("default", "tiny", "custom"):
            raise ValueError(f"kind must be 'default', 'tiny' or 'custom', got {kind!r}")
        self.model, self.kind, self.draft_k, self.lookahead = model, kind, draft_k, tuple(lookahead)
        self.target = target if target is not None else Target(model)
        self.weights = dict(weights or {})
        bad = [k for k in self.weights if k not in WEIGHT_KINDS]
        if bad:
            raise ValueError(f"weights keys must be one of {', '.join(WEIGHT_KINDS)}, got {bad}")
        self.V = int(model.get_output_embeddings().weight.shape[0])
        if isinstance(cost_reps, bool) or not isinstance(cost_reps, int) or cost_reps < 1:
            raise ValueError(f"cost_reps must be an int >= 1, got {cost_reps!r}")
        self.cost_reps = cost_reps
        self._memo: dict = {}

    # ------------------------------------------------------------------ shared parts, built once

    def _once(self, key, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def _path(self, what: str, committed):
        if self.kind == "default":
            return self.weights.get(what, committed)
        if what not in self.weights:
            raise ValueError(f"no trained {what} for this model: pass weights={{'{what}': path}} (a file of "
                             f"`python -m specref train --method {what}`); the committed ones belong to the "
                             "default model")
        return self.weights[what]

    def verify_costs(self) -> dict:
        """costs.measure_verify_cost of this target for W = 1..11 (ratios v(W), fitted c and c0)."""
        from .picker.costs import measure_verify_cost

        return self._once("verify", lambda: measure_verify_cost(self.target, 10, reps=self.cost_reps))

    def ngram_config(self):
        """The adaptive n-gram settings with this machine's verify costs (c, c0 of v(W), W <= 11)."""
        from .ngram import NgramConfig

        def make():
            vc = self.verify_costs()  # the draft length rule needs this machine's costs
            return NgramConfig(k=10, adaptive=True, draft_cost=round(vc["c"], 4), verify_cost_fixed=round(vc["c0"], 4))
        return self._once("ngram", make)

    def suffix(self, name: str):
        """A SuffixProposer for method `name` (suffix, suffix_tree, hybrid_suffix): vLLM's settings but
        k 10 (a CPU's verify cost), and the method's global tree, one per Registry: fresh proposers,
        one cache, so a run's requests (a bench's questions, in order) share it from a cold start."""
        from .suffix import SuffixConfig, SuffixProposer

        cfg = SuffixConfig(k=10, tree=name == "suffix_tree",
                           min_score=float(self.eagle()[1].k) if name == "hybrid_suffix" else 0.0)
        return SuffixProposer(cfg, self._once(("suffix_cache", name), cfg.cache))

    def reset_suffix_caches(self) -> None:
        """Empty global trees for the suffix methods from now on (a bench's timed requests start
        cold, after its warm-up and calibration)."""
        for key in [key for key in self._memo if isinstance(key, tuple) and key[0] == "suffix_cache"]:
            del self._memo[key]

    def trained_draft(self):
        """(draft, token_map, k)."""
        def make():
            from .draft_model import WEIGHTS, build_draft, load_trained_draft, trained_draft_info

            if self.kind == "tiny":  # an untrained reduced-vocabulary draft: exercises the code path only
                tm = torch.arange(0, self.V, 2)
                return build_draft(self.model, 1, tm), tm.to(self.model.device), self.draft_k or 2
            path = self._path("draft", WEIGHTS)
            draft, token_map = load_trained_draft(self.model, path)
            alpha = trained_draft_info(path).get("record", {}).get("heldout", {}).get("heldout_top1")
            return draft, token_map, self.draft_k or self._draft_k(draft, alpha)
        return self._once("draft", make)

    def _draft_k(self, draft, alpha) -> int:
        """k from the closed form (theory.optimal_k) with the draft's held-out alpha and measured c."""
        from .picker.costs import measure_cost
        from .theory import optimal_k

        if alpha is None:
            return 4
        return optimal_k(float(alpha), measure_cost(self.target, draft)["c"], k_max=10)

    def eagle(self, version: int = 1):
        """(head, EagleConfig) of the EAGLE-1 head (version 3: the EAGLE-3 head): k by the closed
        form from the held-out alpha and the measured head cost; per row and step k' <= k by the
        same closed form on the row's measured acceptance, with this machine's costs (a head step
        plus one more verified token, c0)."""
        def make():
            from .picker.costs import fit_verify_cost
            from .eagle_head import EagleConfig
            from .picker.costs import measure_head_cost
            from .theory import optimal_k

            if version == 3:
                from .eagle3 import WEIGHTS, Eagle3Head as Head, eagle3_info as info, load_eagle3 as load
            else:
                from .eagle_head import WEIGHTS, EagleHead as Head, eagle_info as info, load_eagle as load
            if self.kind == "tiny":  # an untrained head: exercises the code path only
                head, alpha = Head(self.model, torch.arange(0, self.V, 2)), None
            else:
                path = self._path("eagle3" if version == 3 else "eagle", WEIGHTS)
                from .published import is_published, load_published_eagle, load_published_eagle3

                if is_published(path):  # an EAGLE-1/2 or EAGLE-3 head as its authors ship it
                    head, alpha = (load_published_eagle3 if version == 3 else load_published_eagle)(self.model, path), None
                else:
                    head = load(self.model, path)
                    alpha = info(path)["record"].get("heldout", {}).get("heldout_top1")
            c_head = measure_head_cost(self.target, head, reps=max(15 * self.cost_reps // 9, 5))["c"]
            ek = self.draft_k or (4 if alpha is None else optimal_k(float(alpha), c_head, k_max=10))
            vc = fit_verify_cost(self.verify_costs()["ratios"], ek)  # the shared v(W), W <= ek + 1
            return head, EagleConfig(k=ek, adaptive=True, draft_cost=round(c_head + vc["c"], 4),
                                     verify_cost_fixed=round(vc["c0"], 4))
        return self._once(f"eagle{version}", make)

    def eagle2_config(self):
        """Eagle2Config (the CPU sizes of its defaults) with this machine's verify cost: a node is
        kept only if its path's head probability covers the marginal cost of verifying one more
        token (c of the fitted v(W), W <= 5, the widths the tree uses)."""
        def make():
            from .picker.costs import fit_verify_cost
            from .eagle_tree import Eagle2Config

            n = Eagle2Config().total_tokens
            vc = fit_verify_cost(self.verify_costs()["ratios"], n)
            return Eagle2Config(min_value=round(min(max(vc["c"], 0.0), 0.5), 4))
        return self._once("eagle2", make)

    def medusa_heads(self):
        def make():
            from .medusa_heads import WEIGHTS, MedusaHeads, load_medusa

            if self.kind == "tiny":  # untrained heads: exercises the code path only
                return MedusaHeads(self.model, 3, torch.arange(0, self.V, 2))
            from .published import is_published, load_published_medusa

            path = self._path("medusa", WEIGHTS)
            return (load_published_medusa if is_published(path) else load_medusa)(self.model, path)
        return self._once("medusa", make)

    def hydra_heads(self):
        def make():
            from .medusa_heads import HYDRA_WEIGHTS, MedusaHeads, load_medusa

            if self.kind == "tiny":  # untrained heads: exercises the code path only
                return MedusaHeads(self.model, 3, torch.arange(0, self.V, 2), sequential=True)
            heads = load_medusa(self.model, self._path("hydra", HYDRA_WEIGHTS))
            if not heads.sequential:
                raise ValueError("the hydra weights file holds Medusa heads, not sequential (Hydra) heads: pass it "
                                 "as medusa, or train Hydra heads with `python -m specref train --method medusa --hydra`")
            return heads
        return self._once("hydra", make)

    def mtp_stack(self):
        """(modules, k = max(D, 3) unless draft_k)."""
        def make():
            from .mtp import WEIGHTS, MTPStack, load_mtp

            if self.kind == "tiny":  # an untrained module: exercises the code path only
                stack = MTPStack(self.model, torch.arange(0, self.V, 2))
            else:
                stack = load_mtp(self.model, self._path("mtp", WEIGHTS))
            return stack, self.draft_k or max(stack.num_modules, 3)
        return self._once("mtp", make)

    def mlp_speculator(self):
        """(speculator, k = n_predict unless draft_k, capped at n_predict)."""
        def make():
            from .mlp_speculator import WEIGHTS, MLPSpeculator, load_mlp_speculator

            if self.kind == "tiny":  # an untrained speculator: exercises the code path only
                spec = MLPSpeculator(self.model, 3, token_map=torch.arange(0, self.V, 2))
            else:
                spec = load_mlp_speculator(self.model, self._path("mlp_speculator", WEIGHTS))
            return spec, min(self.draft_k or spec.n_predict, spec.n_predict)
        return self._once("mlp_speculator", make)

    # ------------------------------------------------------------------ the methods

    def proposer(self, name: str):
        """A fresh proposer for method `name` (None for "ar"); ValueError for an unknown name or
        a learned method without weights for this model."""
        from .hybrid import HybridConfig, HybridProposer
        from .ngram import NgramProposer

        check_method(name)
        if name == "ar":
            return None
        if name == "ngram":
            return NgramProposer(self.ngram_config())
        if name == "lookahead":
            from .lookahead import LookaheadConfig, LookaheadProposer

            W, N, G = self.lookahead
            return LookaheadProposer(LookaheadConfig(W=W, N=N, G=G))
        if name in ("draft", "hybrid_draft"):
            from .draft_model import DraftModelConfig, DraftModelProposer

            draft, token_map, k = self.trained_draft()
            p = DraftModelProposer(draft, DraftModelConfig(k=k), token_map=token_map, vocab_size=self.V)
            return p if name == "draft" else HybridProposer(NgramProposer(self.ngram_config()), p)
        if name in ("suffix", "suffix_tree"):
            return self.suffix(name)
        if name in ("eagle", "hybrid", "hybrid_tree", "hybrid_suffix"):
            from .eagle_head import EagleProposer

            head, ec = self.eagle()
            if name == "hybrid_suffix":  # ArcticInference's rule: the suffix draft where score >= k
                return HybridProposer(self.suffix(name), EagleProposer(head, ec))
            if name == "eagle":
                return EagleProposer(head, ec)
            mode = HybridConfig(mode="tree" if name == "hybrid_tree" else "select")
            return HybridProposer(NgramProposer(self.ngram_config()), EagleProposer(head, ec), mode)
        if name in ("eagle2", "hybrid_eagle2", "eagle3_tree"):
            from .eagle_tree import Eagle2Proposer

            p = Eagle2Proposer(self.eagle(3 if name == "eagle3_tree" else 1)[0], self.eagle2_config())
            return p if name != "hybrid_eagle2" else HybridProposer(NgramProposer(self.ngram_config()), p)
        if name == "eagle2_sampled":
            from .eagle_sampled import Eagle2SampledProposer

            return Eagle2SampledProposer(self.eagle()[0], self.eagle2_config())
        if name in ("eagle3", "hybrid_eagle3"):
            from .eagle_head import EagleProposer

            head, ec = self.eagle(3)
            p = EagleProposer(head, ec)
            return p if name == "eagle3" else HybridProposer(NgramProposer(self.ngram_config()), p)
        if name in ("medusa", "medusa_typical", "hybrid_medusa", "hydra", "hybrid_hydra"):
            from .medusa_heads import MedusaConfig, MedusaProposer

            mc = MedusaConfig(acceptance="typical" if name == "medusa_typical" else "lossless")
            p = MedusaProposer(self.hydra_heads() if "hydra" in name else self.medusa_heads(), mc)
            return p if not name.startswith("hybrid") else HybridProposer(NgramProposer(self.ngram_config()), p)
        if name in ("mlp_speculator", "hybrid_mlp_speculator"):
            from .mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorProposer

            spec, k = self.mlp_speculator()
            p = MLPSpeculatorProposer(spec, MLPSpeculatorConfig(k=k))
            return p if name == "mlp_speculator" else HybridProposer(NgramProposer(self.ngram_config()), p)
        from .mtp import MTPConfig, MTPProposer  # "mtp"

        stack, k = self.mtp_stack()
        return MTPProposer(stack, MTPConfig(k=k))

    def label(self, name: str) -> str:
        """A one-line description of the method with its settings (builds what it names)."""
        check_method(name)
        if name == "ar":
            return "specref autoregressive (baseline)"
        costs = lambda c: f"c {c.draft_cost:.3f}, c0 {c.verify_cost_fixed:.3f}"  # noqa: E731
        if name == "ngram":
            ng = self.ngram_config()
            return f"specref n-gram (adaptive, k<={ng.k}; {costs(ng)})"
        if name == "lookahead":
            W, N, G = self.lookahead
            return f"specref lookahead (W {W}, N {N}, G {G})"
        if name in ("draft", "hybrid_draft"):
            k = self.trained_draft()[2]
            return (f"specref trained draft (k={k})" if name == "draft"
                    else f"specref n-gram, else trained draft (k={k}; {costs(self.ngram_config())})")
        if name in ("suffix", "suffix_tree", "hybrid_suffix"):
            c = self.suffix(name).config
            what = (f"SuffixDecoding ({'tree' if c.tree else 'path'}, k<={c.k}, depth {c.max_depth}, alpha "
                    f"{c.max_spec_factor:g}, tau {c.min_token_prob:g}, {c.max_cached_requests} cached requests)")
            return f"specref {what}" if name != "hybrid_suffix" else \
                f"specref {what} where its score >= {c.min_score:g}, else EAGLE-1 head (adaptive, k<={c.min_score:g})"
        if name in ("eagle", "hybrid", "hybrid_tree"):
            ec = self.eagle()[1]
            if name == "eagle":
                return f"specref EAGLE-1 head (adaptive, k<={ec.k}; {costs(ec)})"
            how = " and EAGLE-1 head as a 2-branch tree" if name == "hybrid_tree" else ", else EAGLE-1 head"
            return (f"specref n-gram{how} (adaptive, k<={ec.k}; {costs(self.ngram_config())} / "
                    f"{costs(ec)})")
        if name in ("eagle2", "hybrid_eagle2", "eagle3_tree", "eagle2_sampled"):
            t = self.eagle2_config()
            tree = (f"EAGLE-2 tree (top_k {t.top_k}, depth {t.depth}, <= {t.total_tokens} nodes, "
                    f"V >= {t.min_value:.3f})")
            if name == "eagle2_sampled":
                return f"specref EAGLE-1 head, {tree[:-1]}, siblings sampled without replacement)"
            if name == "eagle3_tree":
                return f"specref EAGLE-3 head, {tree}"
            return f"specref EAGLE-1 head, {tree}" if name == "eagle2" else \
                f"specref n-gram, else {tree} ({costs(self.ngram_config())})"
        if name in ("eagle3", "hybrid_eagle3"):
            ec = self.eagle(3)[1]
            return (f"specref EAGLE-3 head (adaptive, k<={ec.k}; {costs(ec)})" if name == "eagle3" else
                    f"specref n-gram, else EAGLE-3 head (adaptive, k<={ec.k}; {costs(self.ngram_config())} / "
                    f"{costs(ec)})")
        if name in ("medusa", "medusa_typical", "hybrid_medusa"):
            heads = self.medusa_heads()
            n = self.proposer("medusa").k
            if name == "hybrid_medusa":
                return f"specref n-gram, else Medusa heads ({n}-node tree; {costs(self.ngram_config())})"
            rule = "typical acceptance, LOSSY at T > 0" if name == "medusa_typical" else "lossless"
            return f"specref Medusa heads ({heads.num_heads} heads, {n}-node tree; {rule})"
        if name in ("hydra", "hybrid_hydra"):
            heads, n = self.hydra_heads(), self.proposer("hydra").k
            if name == "hybrid_hydra":
                return f"specref n-gram, else Hydra heads ({n}-node tree; {costs(self.ngram_config())})"
            kind = heads.prefix_kind
            pre = "" if kind is None else " on an EAGLE-1 prefix" if kind == "eagle" else f" on a '{kind}' prefix"
            return f"specref Hydra heads ({heads.num_heads} sequential heads{pre}, {n}-node tree; lossless)"
        if name in ("mlp_speculator", "hybrid_mlp_speculator"):
            spec, k = self.mlp_speculator()
            what = f"MLP speculator (n={spec.n_predict}, k={k}{', tied' if spec.tie_weights else ''})"
            return f"specref {what}" if name == "mlp_speculator" else \
                f"specref n-gram, else {what} ({costs(self.ngram_config())})"
        stack, k = self.mtp_stack()
        return f"specref MTP modules (D={stack.num_modules}, k={k}; module D reused after)"
