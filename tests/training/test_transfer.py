"""Tests of training/transfer.py: per-category agreement is the held-out evaluation, split by category."""
import pytest

from specref.training.loop import TrainConfig, evaluate
from specref.training.transfer import per_category, to_markdown

from test_training import _data, _target, _task


def test_per_category_splits_the_heldout_evaluation():
    target = _target()
    seqs = _data(target, n=12)
    task = _task(target, seqs)
    cats = ["a", "b", "a", "c"] * 3
    res = per_category(task, seqs, cats, batch_size=4)
    assert sorted(res) == ["a", "all", "b", "c"]
    whole = evaluate(task, seqs, TrainConfig(batch_size=4))
    assert res["all"]["top1"] == pytest.approx(whole["top1"]) and res["all"]["accept"] == pytest.approx(whole["accept"])
    n = {c: res[c]["positions"] for c in "abc"}
    assert sum(n.values()) == res["all"]["positions"] == 12 * 20
    mean = sum(res[c]["top1"] * n[c] for c in "abc") / res["all"]["positions"]
    assert res["all"]["top1"] == pytest.approx(mean)  # position-weighted
    only_b = evaluate(task, [s for s, c in zip(seqs, cats) if c == "b"], TrainConfig(batch_size=4))
    assert res["b"]["top1"] == pytest.approx(only_b["top1"])
    assert res["b"]["coverage"] == pytest.approx(only_b["coverage"])
    cut = per_category(task, seqs[:2], ["a", "a"], batch_size=4, max_len=3)  # prompts (4 tokens) longer than max_len
    assert cut["a"]["positions"] == 0 and cut["a"]["top1"] == 0
    table = to_markdown({"old": {"heldout_top1": 0.5, "categories": res}, "new": {"heldout_top1": None,
                                                                               "categories": res}})
    assert table.count("\n") == 3 and "| old | 0.500 |" in table and "| new | n/a |" in table
