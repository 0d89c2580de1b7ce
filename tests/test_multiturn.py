"""The multi-turn workload (workloads.py: conversations, first-answers files, second turns; bench/multiturn.py:
the builder and `python -m specref multiturn`): the shipped two-turn set, the file format's round trip,
the second-turn messages, and the errors for answers of another question file."""
import json

import pytest

from specref import workloads
from specref.__main__ import main
from specref.bench.multiturn import first_answers


def test_the_shipped_set():
    rows = workloads.load_conversations()
    assert len(rows) == 50 and len({r["question_id"] for r in rows}) == 50
    assert all(len(r["turns"]) == 2 and all(len(t) > 10 for t in r["turns"]) for r in rows)
    assert len({r["category"] for r in rows}) == 9


def test_no_text_of_spec_bench():
    """Zero 8-gram overlap with Spec-Bench's questions (where the file is given)."""
    import re

    path = workloads.spec_bench_file(required=False)
    if path is None:
        pytest.skip("Spec-Bench's question file is not given (SPECREF_SPEC_BENCH)")

    def grams(t, n=8):
        w = re.findall(r"\w+", t.lower())
        return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}

    theirs = set().union(*(grams(t) for r in map(json.loads, open(path, encoding="utf-8")) for t in r["turns"]))
    assert not any(grams(t) & theirs for r in workloads.load_conversations() for t in r["turns"])


def test_first_answers_round_trip_and_second_turns(tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text("\n".join(json.dumps(r) for r in (
        {"question_id": "a", "category": "math", "turns": ["What is 2 + 2?", "And times 3?"]},
        {"question_id": "b", "category": "qa", "turns": ["One turn only."]},  # not a conversation
        {"question_id": 7, "category": "writing", "turns": ["Write a line.", "Shorter.", "Third."]})) + "\n")
    rows = workloads.load_conversations(q)
    assert [r["question_id"] for r in rows] == ["a", 7]
    answers = first_answers(rows, lambda msgs: msgs[-1]["content"].upper())  # a stand-in for the model
    assert answers == {"a": "WHAT IS 2 + 2?", 7: "WRITE A LINE."}
    out = tmp_path / "answers.jsonl"
    workloads.write_first_answers(out, q, answers, "stub", 16)
    meta, back = workloads.load_first_answers(out)
    assert back == answers and meta["model"] == "stub" and meta["questions"]["sha256"] == workloads.sha256_of(q)
    second = workloads.second_turns(q, out)
    assert second[0]["messages"] == [{"role": "user", "content": "What is 2 + 2?"},
                                     {"role": "assistant", "content": "WHAT IS 2 + 2?"},
                                     {"role": "user", "content": "And times 3?"}]
    assert second[1]["question_id"] == 7 and second[1]["messages"][2]["content"] == "Shorter."
    q.write_text(q.read_text() + json.dumps({"question_id": "c", "turns": ["x", "y"]}) + "\n")
    with pytest.raises(ValueError, match="answers to another question file"):
        workloads.second_turns(q, out)
    workloads.write_first_answers(out, q, answers, "stub", 16)
    with pytest.raises(ValueError, match="no first answer for question 'c'"):
        workloads.second_turns(q, out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "turns": "not a list"}) + "\n")
    with pytest.raises(ValueError, match="'turns' must be a list"):
        workloads.load_conversations(bad)
    with pytest.raises(ValueError, match="not a first-answers file"):
        workloads.load_first_answers(q)


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["multiturn", "--help"])
    assert e.value.code == 0 and "first answers" in capsys.readouterr().out
