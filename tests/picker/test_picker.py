"""The strategy picker (picker.py, calibration.py): its prediction is the closed form of the measured
terms, "do not speculate" where the closed form says so, the replay of a greedy answer counts what
a real run counts, and bad input is a ValueError. No timing is asserted (speed never goes into a
test): the costs below are synthetic."""
from __future__ import annotations

import pytest
import torch

from specref import picker, theory
from specref.picker import Calibration, Replay, calibrate, fit_verify_curve
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import tiny_model
from specref.registry import Registry

STEPS = 100_000


def _record(method, alpha=0.0, k=0, f=1.0, cost=1.0, setup=0.0, prefill=0.0, prompt=0, group="all"):
    """Counters of a run whose per-position acceptance is exactly alpha, drafting k on a fraction f
    of the steps; a step costs `cost` autoregressive steps (t_ar = 1 s)."""
    drafts = round(f * STEPS)
    dp = [drafts] * k
    acc = [round(drafts * alpha ** (i + 1)) for i in range(k)]
    return dict(prompt=prompt, group=group, method=method, mode="synthetic", steps=STEPS, drafts=drafts,
                drafted_pos=dp, acc_pos=acc, tokens=0, draft_s=0.01 * sum(dp), verify_s=0.0, begin_s=setup,
                setup_s=setup, prefill_s=prefill, wall_s=0.0, step_s=cost, t_ar_s=1.0, t1_s=1.0, k=k or None)


def _cal(records, methods, **cfg):
    return Calibration(config=picker.PickerConfig(**cfg), methods=methods, labels={},
                       records=[_record("ar", prompt=r["prompt"], group=r["group"]) for r in records
                                if r["method"] == methods[0]] + records, verify_ratios=[1.0] * 12)


@pytest.mark.parametrize("alpha,k,c", [(0.3, 2, 0.05), (0.7, 4, 0.1), (0.9, 6, 0.2)])
def test_prediction_is_the_closed_form(alpha, k, c):
    # Leviathan et al. Theorem 3.8: (1 - a^(k+1)) / ((1 - a)(1 + c k)), the step costing 1 + c k
    cal = _cal([_record("m", alpha, k, cost=1 + c * k)], ["m"], max_new_tokens=10_000)
    p = picker.predict(cal)["m"]
    assert p["tau"] == pytest.approx(theory.expected_tokens(alpha, k), rel=1e-4)
    assert p["speedup"] == pytest.approx(theory.speedup(alpha, k, c), rel=1e-4)
    assert p["steady"] == pytest.approx(theory.speedup(alpha, k, c), rel=1e-4)


def test_draft_fraction_and_setup_enter_the_prediction():
    # drafting on a fraction f of the steps: tau = (1 - f) + f E (the bench's mixed closed form)
    a, k, f = 0.6, 5, 0.3
    E = theory.expected_tokens(a, k)
    cal = _cal([_record("m", a, k, f=f, cost=1.1, setup=50.0, prefill=20.0)], ["m"], max_new_tokens=200)
    p = picker.predict(cal)["m"]
    tau = (1 - f) + f * E
    assert p["tau"] == pytest.approx(tau, rel=1e-4)
    assert p["steady"] == pytest.approx(tau / 1.1, rel=1e-4)
    assert p["speedup"] == pytest.approx((20 + 200) / (20 + 50 + 200 / tau * 1.1), rel=1e-4)
    assert p["f"] == pytest.approx(f, abs=1e-4)


def test_best_fixed_k_is_the_optimal_k():
    # a flat verify curve, no loop time: the best fixed k is theory.optimal_k's
    for alpha, c in ((0.5, 0.05), (0.8, 0.1), (0.3, 0.02)):
        rec = _record("eagle", alpha, 10)
        rec["draft_s"] = c * sum(rec["drafted_pos"])  # c per drafted token (t_1 = 1 s)
        cal = _cal([rec], ["eagle"])
        k, s = picker.predict(cal)["eagle"]["best_k"]
        assert k == theory.optimal_k(alpha, c, k_max=10)
        assert s == pytest.approx(theory.speedup(alpha, k, c), rel=1e-3)


def test_do_not_speculate_where_the_closed_form_says_so():
    cfg = picker.PickerConfig(max_new_tokens=128)
    bad = picker.predict(_cal([_record("m", 0.1, 3, cost=1.3)], ["m"], max_new_tokens=128))
    method, why = picker.choose(bad, cfg)
    assert method == "ar" and "do not speculate" in why and "drafts do not pay" in why
    assert theory.speedup(0.1, 3, 0.1) < 1  # the same verdict as the closed form
    # pays per step, but the setup is not repaid in 8 new tokens
    few = picker.predict(_cal([_record("m", 0.8, 4, cost=1.2, setup=30.0)], ["m"], max_new_tokens=8))
    method, why = picker.choose(few, picker.PickerConfig(max_new_tokens=8))
    assert method == "ar" and "few new tokens" in why
    good = picker.predict(_cal([_record("m", 0.8, 4, cost=1.2)], ["m"], max_new_tokens=128))
    assert picker.choose(good, cfg)[0] == "m"


def test_groups_predict_apart():
    recs = [_record("m", 0.9, 4, cost=1.2, prompt=0, group="rag"), _record("m", 0.1, 4, cost=1.2, prompt=1,
                                                                         group="writing")]
    cal = _cal(recs, ["m"], max_new_tokens=1000)
    assert picker.predict(cal, group="rag")["m"]["speedup"] > 2 > 1 > picker.predict(cal, group="writing")["m"]["speedup"]
    with pytest.raises(ValueError, match="no calibration runs"):
        picker.predict(cal, group="math")


def test_verify_curve_fit_recovers_the_costs():
    # seconds = t1_p v(W) with noise-free points; widths 1..4 seen, 8 unseen (the prior's shape, scaled)
    true_v = {1: 1.0, 2: 1.05, 3: 1.08, 4: 1.12}
    t1 = {0: 0.08, 1: 0.1, 2: 0.13}
    points = {p: [(W, t * true_v[W]) for W in (1, 2, 2, 3, 3, 4) for _ in range(2)] for p, t in t1.items()}
    prior = [1.0, 1.2, 1.3, 1.4, 1.45, 1.5, 1.55, 1.6]  # a synthetic curve, too steep
    fit_t1, ratio = fit_verify_curve(points, prior)
    for p in t1:
        assert fit_t1[p] == pytest.approx(t1[p], rel=1e-6)
    for W, v in true_v.items():
        assert ratio(W) == pytest.approx(v, rel=1e-6)
    scale = sorted(true_v[W] / prior[W - 1] for W in (2, 3, 4))[1]  # the median ratio to the prior
    assert ratio(8) == pytest.approx(prior[7] * scale, rel=1e-6)


# ----------------------------------------------------------------------------- on a tiny model


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", vocab_size=96, init_std=0.2, logit_scale=2.0)
    return model, Registry(model, kind="tiny", draft_k=3)


PROMPTS = [[1, 5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6], [1, 20, 21, 22, 23, 24, 20, 21, 22], [1, 40, 41, 42, 40, 41]]


@pytest.mark.parametrize("method", ["ar", "ngram", "eagle", "draft", "medusa", "mtp", "hybrid", "hybrid_tree"])
def test_replay_counts_what_a_real_run_counts(tiny, method):
    model, reg = tiny
    ids = torch.tensor([PROMPTS[0]])
    n = 24
    real_p = reg.proposer(method)
    real = (autoregressive_generate(reg.target, ids, max_new_tokens=n, temperature=0.0, eos_token_id=None)
            if real_p is None else speculative_generate(reg.target, real_p, ids, max_new_tokens=n,
                                                        temperature=0.0, eos_token_id=None))
    z = torch.tensor(PROMPTS[0] + real.row(0))
    full = reg.target.prefill(reg.target.new_cache(1, z.shape[0] + 1), z[None, :-1],
                              torch.tensor([z.shape[0] - 1]), logits=False, hidden_layers=(-1,))
    rp = Replay(reg.target, z, full.hidden[0])
    p = reg.proposer(method)
    rep = (autoregressive_generate(rp, ids, max_new_tokens=n, temperature=0.0, eos_token_id=None) if p is None
           else speculative_generate(rp, p, ids, max_new_tokens=n, temperature=0.0, eos_token_id=None))
    assert rep.row(0) == real.row(0)
    a, b = real.stats, rep.stats
    assert (b.target_forwards, b.num_drafts, b.drafted_per_position, b.accepted_per_position) == \
        (a.target_forwards, a.num_drafts, a.drafted_per_position, a.accepted_per_position)
    assert len(rp.widths) == a.target_forwards


def test_calibrate_and_recommend_end_to_end(tiny):
    model, reg = tiny
    cfg = dict(methods=("ngram", "eagle", "lookahead"), replay_tokens=16, calib_tokens=4, budget_s=None,
               progress=False)
    cal = calibrate(model, PROMPTS, picker.PickerConfig(**cfg), reg, groups=["a", "a", "b"])
    assert {(r["prompt"], r["method"]) for r in cal.records} == {(i, m) for i in range(3)
                                                                 for m in ("ar", "ngram", "eagle", "lookahead")}
    assert {r["mode"] for r in cal.records if r["method"] == "lookahead"} == {"real"}
    assert {r["mode"] for r in cal.records if r["method"] != "lookahead"} == {"replay"}
    for g in ("a", "b", None):
        pred = picker.predict(cal, group=g)
        assert set(pred) == {"ar", "ngram", "eagle", "lookahead"} and pred["ar"]["speedup"] == 1.0
        assert all(p["speedup"] > 0 and p["tau"] >= 1 for p in pred.values())
    rec = picker.recommend(model, PROMPTS[:1], registry=reg, **cfg)
    assert rec.method in rec.predicted and "|" in rec.table() and rec.to_json()["method"] == rec.method
    ids = torch.tensor([PROMPTS[0]])
    out = (autoregressive_generate(reg.target, ids, max_new_tokens=8, temperature=0.0) if rec.proposer is None
           else speculative_generate(reg.target, rec.proposer, ids, max_new_tokens=8, temperature=0.0))
    assert out.num_tokens.item() >= 1
    # T > 0 and batch > 1: every method measured for real, in windows of one generation
    for extra in (dict(temperature=0.8), dict(batch_size=2)):
        cal = calibrate(model, PROMPTS, picker.PickerConfig(**{**cfg, "methods": ("ngram", "eagle"), **extra}), reg)
        assert {r["mode"] for r in cal.records} == {"real"}
        assert set(picker.predict(cal)) == {"ar", "ngram", "eagle"}


def test_answer_and_replays_are_bounded_by_time_not_tokens(tiny, monkeypatch):
    """The real answer runs for replay_tokens autoregressive steps' time (at most max_new_tokens
    tokens) and each replay for a share of that: with an unbounded budget every run covers
    max_new_tokens, with a vanishing replay share every replay stops after its first step and is
    still counted on the answer's prefix (no timing is asserted: only the two limits)."""
    import specref.picker.calibration as calib

    model, reg = tiny
    methods = ("ngram", "eagle", "draft", "hybrid")
    cfg = dict(methods=methods, max_new_tokens=20, budget_s=None, progress=False)
    full = calibrate(model, PROMPTS, picker.PickerConfig(replay_tokens=10**9, **cfg), reg)
    assert {r["tokens"] for r in full.records} == {20}
    monkeypatch.setattr(calib, "REPLAY_SHARE", 1e-12)
    short = calibrate(model, PROMPTS, picker.PickerConfig(replay_tokens=10**9, **cfg), reg)
    assert {r["steps"] for r in short.records} == {1}  # one step, then the clock
    assert all(1 <= r["tokens"] < 20 for r in short.records)
    assert set(picker.predict(short)) == {"ar", *methods}


def test_bad_input(tiny):
    model, reg = tiny
    with pytest.raises(ValueError, match="at least one prompt"):
        calibrate(model, [], picker.PickerConfig(), reg)
    with pytest.raises(ValueError, match="prompt 0"):
        calibrate(model, [[]], picker.PickerConfig(), reg)
    with pytest.raises(ValueError, match="unknown method"):
        picker.PickerConfig(methods=("eagle", "nope"))
    for bad in (0, -1.0, "10"):
        with pytest.raises(ValueError, match="budget_s"):
            picker.PickerConfig(budget_s=bad)
    with pytest.raises(ValueError, match="max_new_tokens"):
        picker.PickerConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        picker.PickerConfig(temperature=-0.1)
    with pytest.raises(ValueError, match="groups"):
        calibrate(model, PROMPTS, picker.PickerConfig(), reg, groups=["a"])


def test_calibration_sample_covers_the_workload():
    """The calibration takes the prompts in a seeded order, round-robin over categories, long and
    short alternating within each: a budget that stops after a few prompts has still seen every
    category (file order would have seen only the first)."""
    from specref.picker import sample_order

    groups = [c for c in "abcd" for _ in range(6)]  # 4 categories, 6 prompts each, in file order
    prompts = [[1] * (1 + (i % 6) * 10) for i in range(24)]  # lengths 1..51 within each category
    order = sample_order(prompts, groups, seed=0)
    assert sorted(order) == list(range(24))
    assert {groups[i] for i in order[:4]} == set("abcd")  # the first 4 cover every category
    for c in "abcd":
        first_two = [i for i in order if groups[i] == c][:2]
        lengths = sorted(len(prompts[i]) for i in first_two)
        assert lengths[0] <= 21 < lengths[1]  # one from the shorter half, one from the longer
    assert sample_order(prompts, groups, seed=0) == order and sample_order(prompts, groups, seed=1) != order


def test_the_budget_follows_the_workload():
    """budget_s="auto": 5% of the workload's expected autoregressive time, within [30, 600] s."""
    from specref.picker import budget_for

    t1 = 0.05  # seconds per one-token forward
    assert budget_for(240, 128, t1) == pytest.approx(0.05 * 240 * 128 * t1)  # 76.8 s
    assert budget_for(480, 128, t1) == pytest.approx(2 * budget_for(240, 128, t1))  # twice the workload
    assert budget_for(4, 16, t1) == 30.0 and budget_for(100_000, 512, t1) == 600.0  # the clamps
    assert budget_for(960, 128, t1, batch_size=4) == pytest.approx(budget_for(240, 128, t1))  # batches of 4
    assert picker.PickerConfig().budget_s == "auto" and picker.PickerConfig(budget_s=12.5).budget_s == 12.5
    with pytest.raises(ValueError, match="budget_s"):
        picker.PickerConfig(budget_s="soon")
