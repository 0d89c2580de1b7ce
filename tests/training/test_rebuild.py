"""`python -m specref rebuild` (training/rebuild.py, recipes.py): every step of every chain is a command
its parser takes; a chain reads only what it wrote before it, a committed corpus part or a committed
file; each chain ends as the committed file it rebuilds (the stores and settings of its runs as the
file's record holds them, its int4 matrices and references as the file's); the runner runs the steps in order, skips
what is done, stops at a failing step by name and resumes there."""
import json
from pathlib import Path

import pytest

from specref.training import rebuild as rb
from specref.training.cli import train_parser
from specref.training.committed_corpus import corpus_parser, read_corpus_manifest
from specref.training.recipes import RECIPES, STORES
from specref.training.store import data_parser
from specref.weights import read_weights
from specref.weights.cli import compact_parser

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ROOT / "specref" / "weights"


def _parse(step: rb.Step):
    """The step's arguments as its own command parses them (argparse exits on an unknown flag)."""
    if step.kind == "export":
        return corpus_parser().parse_args(["--root", "corpus", "export", *step.args])
    if step.kind == "score":
        return data_parser().parse_args(list(step.args))
    if step.kind == "train":
        return train_parser().parse_args(list(step.args))
    return compact_parser().parse_args(["compact", *step.args])


def _steps(name):
    return [s for _, s in rb.plan([name])]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_step_parses_and_reads_only_what_came_before(name):
    parts = {p["name"] for p in read_corpus_manifest(ROOT / "corpus")["parts"]}
    written = {}  # out -> kind
    for s in _steps(name):
        a = _parse(s)
        if s.kind == "export":
            assert a.out == s.out and set(a.parts) <= parts, s
        elif s.kind == "score":
            assert written.get(a.distilled) == "export" and a.out == s.out, s
            assert a.sources == [], f"{s}: a bare --sources scores the distilled answers only, as every store did"
        elif s.kind == "train":
            assert all(written.get(x) == "score" for x in a.store), s
            for f in (a.init, getattr(a, "prefix_from", None)):  # --prefix-from: medusa's own flag
                if f is not None and f.startswith("{weights:"):
                    assert f[len("{weights:"):-1] in RECIPES and f != f"{{weights:{name}}}", s
                else:
                    assert f is None or written.get(f) in ("train", "compact"), s
            assert a.export == s.out and a.out.startswith("runs/"), s
        else:
            assert written.get(a.files[0]) in ("train", "compact") and a.out == s.out, s
            if a.ref is not None:  # a reference to a committed (or rebuilt) file, by its name
                assert a.ref[1].startswith("{weights:") and a.ref[1][len("{weights:"):-1] in RECIPES, s
        assert s.out not in written, f"{s.out} written twice"
        written[s.out] = s.kind
    assert s.out == rb.final_name(name)


def _record_train(rec):
    """(stores by name, the training settings) of a record, whichever of its two layouts."""
    data = rec.get("data", rec)
    return data["store"], rec["train"]


def _check_run(step, rec, fp32):
    """The run's stores (names; dtype, through the target's fingerprint in each store's manifest, fp32 being
    the trained file's own; layers; tokens) and training settings as its record holds them."""
    a = _parse(step)
    stores, train = _record_train(rec)
    if not stores[0].startswith("STORE:"):  # the MLP speculator's record names its store by its command
        assert [Path(x).name for x in a.store] == stores, step
    mans = rec.get("data", rec)["manifest"]
    for x, man in zip(a.store, mans, strict=True):
        score = _parse(STORES[x][1])
        assert (score.dtype == "float32") == (man["model_fingerprint"] == fp32), (step, x)
        assert [str(v) for v in man["settings"]["layers"]] == score.layers, (step, x)
        assert man["settings"]["shard_tokens"] == score.shard_tokens, (step, x)
    for key in ("lr", "epochs", "patience", "min_gain", "warmup_steps", "eval_every", "max_len", "batch_size",
                "seed"):
        if key in train:
            assert getattr(a, key) == pytest.approx(train[key]), (step, key)
    if "epochs" not in train:
        assert a.steps == train["steps"], step


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_chain_ends_as_the_committed_file(name):
    steps = _steps(name)
    path = WEIGHTS / rb.final_name(name)
    _, meta = read_weights(path, names=())
    rec = json.loads(meta["record"])
    runs = [s for s in steps if s.kind == "train"]
    fp32 = meta["target_fingerprint"]
    _check_run(runs[-1], rec, fp32)
    if name == "eagle":  # its record nests the records of all its runs, newest first
        nested = []
        r = rec
        while isinstance(r, dict):
            nested.append(r)
            r = r.get("init")
        assert len(nested) == len(runs) == 8
        for step, r in zip(reversed(runs), nested):
            _check_run(step, r, fp32)
    last = _parse(steps[-1])
    int4 = sorted(json.loads(meta.get("int4_tensors", "[]")))
    assert sorted(last.int4 or []) == int4, name
    assert (last.bits == 4) == (meta["storage"] == "int4"), name
    refs = json.loads(meta.get("tensor_refs", "{}"))
    assert refs == ({} if last.ref is None else {last.ref[0]: refs.get(last.ref[0])}), name
    if refs:
        assert refs[last.ref[0]]["file"] == rb.final_name(last.ref[1][len("{weights:"):-1]), name
    assert meta["storage"] in ("int8", "int4", "int8+int4"), name


def _fake_recipes():
    exp = rb.Step("export", ("--out", "EXP", "--parts", "p1"), "EXP")
    stores = {"S": (exp, rb.Step("score", ("--distilled", "EXP", "--sources", "--out", "S"), "S", 2.0))}
    recipes = {
        "a": ["S", rb.Step("train", ("--store", "S", "--export", "A.safetensors"), "A.safetensors", 3.0),
              rb.Step("compact", ("A.safetensors", "--out", rb.final_name("a")), rb.final_name("a"))],
        "b": ["S", rb.Step("train", ("--store", "S", "--init", "{weights:a}", "--export", "B.safetensors"),
                           "B.safetensors"),
              rb.Step("compact", ("B.safetensors", "--out", rb.final_name("b")), rb.final_name("b"))],
    }
    return recipes, stores


class _Runner:
    """Records each command; writes the step's output unless told to fail (exit 1) or to write nothing."""

    def __init__(self, fail_at=None, write=True):
        self.cmds, self.fail_at, self.write = [], fail_at, write

    def __call__(self, cmd, cwd):
        self.cmds.append(cmd)
        if self.fail_at is not None and self.fail_at in cmd:
            return 1
        out = cmd[cmd.index("--out") + 1] if "--export" not in cmd else cmd[cmd.index("--export") + 1]
        if self.write:
            (Path(cwd) / out).write_text("x")
        return 0


def _corpus(tmp_path):
    c = tmp_path / "corpus"
    c.mkdir()
    (c / "manifest.json").write_text("{}")
    return c


def test_runner_runs_in_order_skips_what_is_done_and_resumes_at_a_failure(tmp_path):
    recipes, stores = _fake_recipes()
    corpus, work = _corpus(tmp_path), tmp_path / "work"
    kw = dict(corpus=corpus, weights_dir=tmp_path / "w", recipes=recipes, stores=stores, log=lambda *_: None)
    r = _Runner(fail_at="B.safetensors")
    with pytest.raises(RuntimeError, match=r"'b' stopped at step 5 \(train -> B.safetensors\): exit status 1"):
        rb.run(["a", "b"], work, runner=r, threads=3, **kw)
    # 1. every step once, in order: the shared store scored once; the threads reach scoring and training only
    assert [c[2:5] for c in r.cmds] == [["specref", "corpus", "--root"], ["specref", "data", "--distilled"],
                                        ["specref", "train", "--store"], ["specref.weights", "compact", "A.safetensors"],
                                        ["specref", "train", "--store"]]
    assert r.cmds[0][5] == str(corpus.resolve())
    assert r.cmds[1][-2:] == ["--threads", "3"] and r.cmds[2][-2:] == ["--threads", "3"]
    assert "--threads" not in r.cmds[0] and "--threads" not in r.cmds[3]
    # {weights:a}: a is rebuilt in this plan, so b starts from the rebuilt file
    assert r.cmds[4][r.cmds[4].index("--init") + 1] == str(work.resolve() / rb.final_name("a"))
    # 2. resumed: what is done is skipped, the failed step and the rest run
    r2 = _Runner()
    rb.run(["a", "b"], work, runner=r2, threads=3, **kw)
    assert [c[c.index("--export") + 1] if "--export" in c else c[c.index("--out") + 1] for c in r2.cmds] == [
        "B.safetensors", rb.final_name("b")]
    # 3. all done: nothing runs, whatever the threads; a changed step runs again, and every step after it
    r3 = _Runner()
    rb.run(["a", "b"], work, runner=r3, threads=1, **kw)
    assert r3.cmds == []
    changed = dict(recipes, a=[recipes["a"][0], rb.Step("train", ("--store", "S", "--lr", "1", "--export",
                                                                  "A.safetensors"), "A.safetensors"),
                               recipes["a"][2]])
    rb.run(["a", "b"], work, runner=r3, **dict(kw, recipes=changed))
    assert [c[3] for c in r3.cmds] == ["train", "compact", "train", "compact"]
    # 4. b alone: a is not rebuilt here, so b starts from the committed file
    r4 = _Runner()
    rb.run(["b"], tmp_path / "w2", runner=r4, **kw)
    assert r4.cmds[2][r4.cmds[2].index("--init") + 1] == str((tmp_path / "w").resolve() / rb.final_name("a"))


def test_runner_errors_name_what_is_wrong(tmp_path):
    recipes, stores = _fake_recipes()
    corpus = _corpus(tmp_path)
    kw = dict(weights_dir=tmp_path / "w", recipes=recipes, stores=stores, log=lambda *_: None)
    with pytest.raises(RuntimeError, match=r"step 1 \(export -> EXP\): it did not write EXP"):
        rb.run(["a"], tmp_path / "work", corpus=corpus, runner=_Runner(write=False), **kw)
    with pytest.raises(ValueError, match="no manifest.json"):
        rb.run(["a"], tmp_path / "work", corpus=tmp_path, runner=_Runner(), **kw)
    with pytest.raises(ValueError, match="known: \\['a', 'b'\\]"):
        rb.plan(["c"], recipes, stores)
    with pytest.raises(ValueError, match="names store 'T'"):
        rb.plan(["x"], {"x": ["T"]}, stores)
    with pytest.raises(ValueError, match="must end by writing smollm2_135m_x"):
        rb.plan(["x"], {"x": ["S"]}, stores)
    with pytest.raises(ValueError, match="step kind"):
        rb.Step("bake", (), "x")


def test_the_command_lists_and_prints_the_plan_without_running(tmp_path, capsys):
    assert rb.rebuild_main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"{n}: " in out for n in RECIPES)
    work = tmp_path / "work"
    assert rb.rebuild_main(["mtp", "--dry-run", "--work", str(work), "--corpus", str(ROOT / "corpus")]) == 0
    out = capsys.readouterr().out
    assert "train --method mtp --store S_d S_e" in out and str(WEIGHTS / rb.final_name("eagle")) in out
    assert not work.exists()
    with pytest.raises(SystemExit):
        rb.rebuild_main(["mtp"])  # no --work
