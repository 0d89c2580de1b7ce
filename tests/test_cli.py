"""`python -m specref generate`, `pick` and `demo --compare`, in-process on the test-only tiny model.

Each generate call builds its own tiny model (a seeded random Llama, bench/methods.py's) and
Registry(kind="tiny"): untrained heads, so these check the code paths, not speed or acceptance.
"""
import pytest
import torch

from specref import __main__ as cli
from specref.registry import METHODS, Registry

PROMPT = "the cat sat on the mat, the cat sat on the mat, the cat"


def _gen(*extra):
    return cli.main(["generate", "--model", "tiny", "--prompt", PROMPT, "--max-new-tokens", "8", *extra])


def _token_line(out: str) -> list:
    """The printed token ids (the first line of generate's output after any picker lines)."""
    lines = [ln for ln in out.splitlines() if ln.strip() and all(w.isdigit() for w in ln.split())]
    assert lines, f"no token ids printed:\n{out}"
    return [int(w) for w in lines[0].split()]


@pytest.mark.parametrize("method", list(METHODS))
def test_generate_every_method(method, capsys):
    assert _gen("--method", method) == 0
    out = capsys.readouterr().out
    toks = _token_line(out)
    assert 1 <= len(toks) <= 8 and all(0 <= t < 96 for t in toks)
    assert ("[autoregressive]" if method == "ar" else "[speculative (specref") in out


def test_greedy_methods_agree(capsys):
    """Greedy and lossless: a learned method prints the same tokens as ar (and as --draft ngram)."""
    rows = {}
    for args in (["--method", "ar"], ["--method", "eagle"], ["--draft", "ngram"]):
        assert _gen(*args) == 0
        rows[args[1]] = _token_line(capsys.readouterr().out)
    assert rows["ar"] == rows["eagle"] == rows["ngram"]


def test_draft_still_works_with_k(capsys):
    assert _gen("--draft", "truncated:1", "--k", "3") == 0
    out = capsys.readouterr().out
    assert "truncated:1, k=3" in out and _token_line(out)


def test_unknown_method_lists_valid_names(capsys):
    with pytest.raises(SystemExit) as e:
        _gen("--method", "eagle9")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown method 'eagle9'" in err
    assert all(name in err for name in list(METHODS) + ["auto"])


def test_draft_and_method_conflict(capsys):
    with pytest.raises(SystemExit) as e:
        _gen("--method", "ngram", "--draft", "ngram")
    assert e.value.code == 2
    assert "--method or --draft, not both" in capsys.readouterr().err


@pytest.mark.parametrize("item", ["bogus=/tmp/x.safetensors", "eagle", "eagle="])
def test_weights_bad_kind(item, capsys):
    with pytest.raises(SystemExit) as e:
        _gen("--method", "eagle", "--weights", item)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "KIND=PATH" in err and all(k in err for k in cli.WEIGHT_KINDS)


def test_weights_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _gen("--method", "eagle", "--weights", f"eagle={tmp_path / 'none.safetensors'}")
    assert e.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_weights_not_for_tiny(tmp_path):
    f = tmp_path / "eagle.safetensors"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="does not apply to --model tiny"):
        _gen("--method", "eagle", "--weights", f"eagle={f}")


def test_compare_methods_option():
    with pytest.raises(SystemExit):
        cli.main(["demo", "--compare", "--compare-methods", "ar,nope"])


def test_compare_on_tiny(capsys):
    """demo --compare's per-prompt table (the default model aside): one line per method, ar 1.00x."""
    from specref.bench.methods import load_model
    from types import SimpleNamespace

    model, encode, eos, _ = load_model(SimpleNamespace(model="tiny", dtype="float32", device="cpu"))
    reg = Registry(model, kind="tiny")
    methods = ["ar", "ngram", "eagle", "hybrid", "medusa"]
    speedups = cli.compare(reg, encode(PROMPT), methods, eos, max_new_tokens=8, budget_s=2.0)
    assert list(speedups) == methods and speedups["ar"] == pytest.approx(1.0)
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "tok/s" in ln]
    assert [ln.split()[0] for ln in lines] == methods
    assert all("speed-up" in ln and "tokens/forward" in ln for ln in lines)
    assert "differs" not in out  # greedy: every method gives ar's tokens


def test_generate_auto(capsys):
    assert _gen("--method", "auto", "--budget-s", "3") == 0
    out = capsys.readouterr().out
    picked = [ln.split()[1] for ln in out.splitlines() if ln.startswith("picked: ")]
    assert len(picked) == 1 and picked[0] in METHODS
    assert "| method |" in out  # the table
    assert _token_line(out)


def test_tiny_model_is_seeded():
    """Each call builds the same tiny model: runs are reproducible across calls."""
    a, b = cli._load("tiny")[0], cli._load("tiny")[0]
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_pick_command(tmp_path, capsys):
    import json

    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in (
        {"category": "copy", "turns": [PROMPT]}, {"category": "open", "prompt": "tell me a story"})))
    out_json = tmp_path / "pick.json"
    assert cli.main(["pick", "--model", "tiny", "--prompts", str(f), "--methods", "ngram,eagle",
                     "--max-new-tokens", "16", "--budget-s", "30", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "pick: " in out and "| method |" in out and "  copy: " in out and "  open: " in out
    res = json.loads(out_json.read_text())
    assert set(res["predicted"]) == {"ar", "ngram", "eagle"} and set(res["groups"]) == {"copy", "open"}
    plain = tmp_path / "prompts.txt"
    plain.write_text("one prompt\n\nanother prompt\n")
    assert cli.read_prompts(str(plain)) == (["one prompt", "another prompt"], ["all", "all"])


def test_pick_bad_input(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        cli.main(["pick", "--model", "tiny", "--prompts", str(empty)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"category": "x"}\n')
    with pytest.raises(ValueError, match="no prompt text"):
        cli.main(["pick", "--model", "tiny", "--prompts", str(bad)])
    ok = tmp_path / "ok.txt"
    ok.write_text("hello\n")
    with pytest.raises(ValueError, match="budget-s"):
        cli.main(["pick", "--model", "tiny", "--prompts", str(ok), "--budget-s", "0"])
    with pytest.raises(SystemExit):
        cli.main(["pick", "--model", "tiny", "--prompts", str(ok), "--methods", "eagle9"])
