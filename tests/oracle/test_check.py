"""Tests of the oracle for other implementations (specref/oracle/check.py, selftest.py).

Power (per-test significance alpha / (2 looks * 124 tests) = 3.9e-6 at alpha 1e-3; noncentral
chi-square, oracle.detectable_tv): with 32,000 rows per variant (test_reference_samplers_pass) the
first-position test of every 6-token variant detects a TV deviation of 0.02 with 95% power, and
every variant's (worst: V = 300) detects 0.038. At 10,000 rows (verify_chain) those are 0.036 and
0.067. Detecting TV 0.02 at V = 300 would need 113,000 rows per variant (CLI default: 50,000).
The mutants below deviate by TV 0.1-0.7 on some test, so they are caught at the first look
(62 rows per variant at samples=500 in the self-test), with room to spare. The false-alarm test measures the rate
at alpha 0.2, where a rate is measurable in 20 runs.
"""
import pytest
import torch
from scipy import stats

from specref.oracle.cases import Variant, standard_cases
from specref.oracle.check import _exact, adapt
from specref.oracle.check import check_rejection_sampler as _check
from specref.oracle.cli import oracle_main
from specref.oracle.selftest import (
    MUTANTS,
    false_alarms,
    hf_speculative_sampling,
    reference_chain,
    reference_plain,
    reference_vllm,
)

SMALL = standard_cases()[:2]  # the 6-token cases (q given; q None): joint tests over every cell


def check_rejection_sampler(fn, **kw):
    """These tests ask the token-wise law (the lossless law: test_lossless.py)."""
    return _check(fn, **{"law": "tokenwise", **kw})


def test_reference_samplers_pass():
    rep = check_rejection_sampler(reference_chain, samples=32_000, seed=0)
    assert rep.passed, rep.summary()
    assert not rep.errors and not rep.stopped_early and rep.samples == 32_000 * 18
    assert 0.035 < rep.detectable_tv < 0.04  # the power statement of this file's docstring
    first = [t for t in rep.tests if t.name.startswith("small/") and t.name.endswith(" pos 1")]
    assert len(first) == 4 and all(t.detectable_tv <= 0.02 for t in first)
    kinds = {t.kind for t in rep.tests}
    assert kinds == {"pos", "residual", "bonus", "length", "joint"}
    for t in rep.tests:  # every TV interval is a real interval around the estimate
        assert t.tv.lower <= t.tv.tv <= t.tv.upper


def test_specref_verify_chain_passes():
    rejection = pytest.importorskip("specref.rejection")
    rep = check_rejection_sampler(rejection.verify_chain, samples=10_000, seed=1)
    assert rep.verdict == "INCONCLUSIVE" and not rep.passed, rep.summary()  # detects TV 0.067 > bound 0.05
    assert rep.samples_needed > 10_000


def test_other_calling_conventions():
    # the vLLM-style flattened convention and the one-row plain convention, on the same reference
    assert check_rejection_sampler(reference_vllm, api="vllm", samples=2_000, seed=3).verdict != "FAIL"
    assert check_rejection_sampler(reference_plain, api="plain", samples=300, seed=3, cases=SMALL).verdict != "FAIL"
    # the adapters do not hide mistakes: a mutant through the vLLM convention still fails
    assert check_rejection_sampler(_vllm_mutant, api="vllm", samples=1_000, seed=3).verdict == "FAIL"


def _vllm_mutant(draft_token_ids, num_draft_tokens, draft_probs, target_logits, generator):
    # a vLLM-style sampler that ignores q (accepts each draft with probability p(x))
    B, V = len(num_draft_tokens), target_logits.shape[-1]
    lengths = torch.tensor(num_draft_tokens)
    K = int(lengths.max())
    pos = torch.arange(K + 1)
    draft = torch.full((B, K), -1, dtype=torch.long)
    draft[pos[:K] < lengths[:, None]] = draft_token_ids
    p = torch.full((B, K + 1, V), 1.0 / V)
    p[pos < lengths[:, None] + 1] = torch.softmax(target_logits, -1)
    q = None if draft_probs is None else torch.full((B, K, V), 1.0 / V)
    if q is not None:
        q[pos[:K] < lengths[:, None]] = draft_probs
    return reference_chain(draft, p, q, lengths=lengths, generator=generator, mistake="ignore_q").tokens


def test_false_alarm_rate_consistent_with_alpha():
    # 20 independent checks of the correct sampler at family-wise alpha 0.2: the number that fail
    # must not exceed what alpha allows (one-sided binomial at 1e-3); the first-position p-values of
    # all variants (disjoint rows: independent) must be uniform (KS at 1e-3).
    # (On the 6-token cases, for speed. Bonferroni makes the true rate <= alpha, typically below.)
    fails, pos1 = false_alarms(reference_chain, runs=20, samples=1_000, alpha=0.2, seed=100, cases=SMALL)
    assert stats.binomtest(fails, 20, 0.2, alternative="greater").pvalue > 1e-3, fails
    assert len(pos1) >= 20 * 7
    assert stats.kstest(pos1, "uniform").pvalue > 1e-3


def test_transformers_speculative_sampling_verdict():
    # transformers' _speculative_sampling (batch 1, global RNG) through the plain adapter passes every
    # case at this size. Full-size verdict (20,000 rows per variant, 360,000 calls, 14 min here):
    # PASS, smallest TV detectable with 95% power 0.047, min p 0.0063 against per-test 3.9e-6.
    rep = check_rejection_sampler(hf_speculative_sampling, api="plain", samples=300, seed=4)
    assert rep.verdict != "FAIL", rep.summary()
    # the plain path has power at this size: it rejects a plain-convention mutant
    def no_residual(p, q, draft, g):
        out = reference_chain(draft[None], p[None], None if q is None else q[None], generator=g, mistake="no_residual")
        return out.tokens[0, : int(out.num_accepted[0]) + 1]
    assert check_rejection_sampler(no_residual, api="plain", samples=300, seed=4, cases=SMALL).verdict == "FAIL"


def test_structural_errors_are_reported():
    def no_padding(draft, p, q, *, lengths, generator):  # leaves junk instead of -1 after the output
        out = reference_chain(draft, p, q, lengths=lengths, generator=generator)
        return torch.where(out.tokens < 0, 0, out.tokens), out.num_accepted

    def wrong_accepted(draft, p, q, *, lengths, generator):  # reports a token other than the draft
        out = reference_chain(draft, p, q, lengths=lengths, generator=generator)
        toks = out.tokens.clone()
        toks[:, 0] = torch.where(out.num_accepted > 0, (toks[:, 0] + 1) % p.shape[-1], toks[:, 0])
        return toks, out.num_accepted

    for fn, what in ((no_padding, "not -1"), (wrong_accepted, "differ from the drafts")):
        rep = check_rejection_sampler(fn, samples=800, cases=SMALL)
        assert rep.verdict == "FAIL" and any(what in e for e in rep.errors), rep.errors
    # drops the bonus column: a failed check naming the case, not an exception
    rep = check_rejection_sampler(lambda d, p, q, *, lengths, generator: (d, lengths), samples=8, cases=SMALL)
    assert rep.verdict == "FAIL" and rep.errors[0].startswith("small: malformed output") and "shape" in rep.errors[0]


@pytest.mark.parametrize("api,fn,what", [
    ("plain", lambda p, q, d, g: None, "not a tensor"),
    ("plain", lambda p, q, d, g: torch.zeros(d.numel() + 2, dtype=torch.long), "emitted"),
    ("plain", lambda p, q, d, g: torch.zeros(0, dtype=torch.long), "emitted 0 tokens"),
    ("vllm", lambda ids, n, dp, lg, g: None, "not a tensor"),
    ("vllm", lambda ids, n, dp, lg, g: torch.zeros(len(n), max(n) + 3, dtype=torch.long), "shape"),
    ("vllm", lambda ids, n, dp, lg, g: torch.zeros(len(n) * (max(n) + 1), dtype=torch.float), "integer"),
    ("specref", lambda d, p, q, *, lengths, generator: None, "ChainResult"),
    ("specref", lambda d, p, q, *, lengths, generator: 1 / 0, "raised ZeroDivisionError"),
])
def test_malformed_output_is_a_failed_check(api, fn, what):
    # every convention turns a malformed output into a structural failure naming the case
    rep = check_rejection_sampler(fn, api=api, samples=8, cases=SMALL)
    assert rep.verdict == "FAIL" and len(rep.errors) == 2, rep.errors
    assert rep.errors[0].startswith("small: ") and rep.errors[1].startswith("qnone: ")
    assert what in rep.errors[0], rep.errors


def test_per_row_generators():
    # one torch.Generator per row (verify_chain's per-row path, batch independence): correct samplers
    # pass; a sampler whose rows all replay the first row's generator (same uniforms in every row) fails
    seen = []

    def spy(draft, p, q, *, lengths, generator):
        seen.append((type(generator), len(generator), len({id(g) for g in generator})))
        return reference_chain(draft, p, q, lengths=lengths, generator=generator)
    assert check_rejection_sampler(spy, samples=300, cases=SMALL, per_row_generators=True).verdict != "FAIL"
    assert all(t is list and n == k for t, n, k in seen)
    rejection = pytest.importorskip("specref.rejection")
    assert check_rejection_sampler(rejection.verify_chain, samples=2_000, seed=5, per_row_generators=True).verdict != "FAIL"
    assert check_rejection_sampler(reference_plain, api="plain", samples=200, seed=5, cases=SMALL,
                                   per_row_generators=True).verdict != "FAIL"

    def replayed(draft, p, q, *, lengths, generator):
        state = generator[0].get_state()
        gens = [torch.Generator().set_state(state) for _ in generator]  # every row a copy of row 0's stream
        return rejection.verify_chain(draft, p, q, lengths=lengths, generator=gens)
    assert check_rejection_sampler(replayed, samples=300, cases=SMALL, per_row_generators=True).verdict == "FAIL"


def test_exact_distribution_by_hand():
    # V = 2, L = 1: p_1 = [0.5, 0.5], q_1 = [0.75, 0.25] -> alpha = 0.5 + 0.25 = 0.75
    v = Variant(torch.tensor([[0.5, 0.5], [0.2, 0.8]]), torch.tensor([[0.75, 0.25]]), None, 1, "hand")
    p, q, m, alpha, plen = _exact(v, 2)
    assert alpha.tolist() == [0.75]
    assert plen.tolist() == [0.25, 0.75]  # reject with 0.25, accept with 0.75
    assert m.tolist() == [[0.5, 0.25]]  # P(accept and token 0) = 0.5, token 1: 0.25
    # q None: one-hot on the draft token 1 -> accept with p(1) = 0.5
    v = Variant(torch.tensor([[0.5, 0.5], [0.2, 0.8]]), None, torch.tensor([1]), 1, "hand")
    assert _exact(v, 2)[4].tolist() == [0.5, 0.5]


def test_cli(capsys):
    # exit status 0 PASS, 1 FAIL, 3 INCONCLUSIVE (1,000 rows per variant cannot detect TV 0.05)
    assert oracle_main(["--sampler", "specref.oracle.selftest:reference_chain", "--samples", "1000"]) == 3
    out = capsys.readouterr().out
    assert "verdict: INCONCLUSIVE (law lossless" in out and "rows per variant needed" in out
    # a looser bound asks for fewer rows (~15,000 per variant for TV 0.2: the depths of a step summed)
    assert oracle_main(["--sampler", "specref.oracle.selftest:reference_chain", "--samples", "25000",
                        "--tv-bound", "0.2"]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    assert oracle_main(["--sampler", "specref.oracle.selftest:mutant_inverted_ratio", "--samples", "1000",
                        "--law", "tokenwise"]) == 1
    assert "verdict: FAIL (law tokenwise" in capsys.readouterr().out
    assert oracle_main(["--sampler", "specref.oracle.selftest:mutant_inverted_ratio", "--samples", "1000"]) == 1
    with pytest.raises(ValueError, match="module:function"):
        oracle_main(["--sampler", "reference_chain"])


def test_self_test_rejects_every_mutant(capsys):
    # `python -m specref oracle --self-test`: every mutant (MUTANTS: nine different mistakes) must
    # fail and every correct sampler pass, at samples=500 (mutants stop at the first look, 62 rows per variant).
    assert oracle_main(["--self-test", "--samples", "500", "--false-alarm-runs", "0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "self-test: PASS"
    for name in MUTANTS:
        assert any(line.startswith(f"ok  {name} ") and "expected FAIL, got FAIL" in line for line in lines), name
    assert sum(line.startswith("ok ") for line in lines) == len(MUTANTS) + 3 + ("verify_chain" in lines[0])


def test_value_errors():
    with pytest.raises(ValueError, match="api"):
        adapt(reference_chain, "sglang")
    with pytest.raises(ValueError, match="samples"):
        check_rejection_sampler(reference_chain, samples=4)
    with pytest.raises(ValueError, match="alpha"):
        check_rejection_sampler(reference_chain, alpha=1.5)
    for kw, match in ((dict(api="sglang"), "api"), (dict(samples=100.0), "samples"), (dict(samples=True), "samples"),
                      (dict(seed=-3), "seed"), (dict(seed=1.5), "seed"), (dict(seed=None), "seed")):
        with pytest.raises(ValueError, match=match):
            check_rejection_sampler(reference_chain, **kw)
    with pytest.raises(ValueError, match="mistake"):
        reference_chain(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 2, 2) / 2, None, mistake="typo")
