"""Training to convergence (training/loop.py, store/files.py, cli.py): the budget in epochs or tokens,
the stopping rule, --init for every head type, a streamed store trains like an in-memory one, and
the levers (EAGLE-1 loss weights, EAGLE-3 training-time-test depth, draft vocabulary, label dtype)
reach the settings they name."""
import json
from dataclasses import replace

import pytest
import torch

from specref.training.data import collate
from specref.training.loop import TrainConfig, budget_steps, evaluate, fit, stopped
from specref.training.store import StoreConfig, build_store, store_split

from test_store import _sources
from test_training import V, _target

STORE = StoreConfig(tokens=2000, max_len=48, batch_tokens=256, shard_tokens=400, topk=8, layers=("final", 0, 1, 2))
TCFG = TrainConfig(steps=3, batch_size=8, lr=3e-3, warmup_steps=1, eval_every=3, max_len=48, seed=0)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("store")
    build_store(_target(), None, _sources(80, seed=1), path, STORE, progress=False)
    return path


def test_budget_in_epochs_or_tokens_and_the_stopping_rule():
    lengths = [10] * 20  # 3 batches of 8 per epoch, 200 tokens
    cfg = TrainConfig(steps=7, batch_size=8)
    assert budget_steps(lengths, cfg) == 7
    assert budget_steps(lengths, replace(cfg, epochs=2.0)) == 6
    assert budget_steps(lengths, replace(cfg, epochs=0.5)) == 2
    assert budget_steps(lengths, replace(cfg, tokens=1000)) == 15  # 1000 tokens / (200 / 3 per batch)
    rows = lambda *v: [{"heldout_top1": x} for x in v]  # noqa: E731
    cfg = replace(cfg, patience=2, min_gain=0.01)
    assert not stopped(rows(0.1, 0.2, 0.3), cfg)
    assert not stopped(rows(0.1, 0.3, 0.305, 0.32), cfg)  # the last one gained 0.02 on 0.3
    assert stopped(rows(0.1, 0.3, 0.305, 0.309), cfg)  # two evaluations gained < 0.01
    assert stopped(rows(0.1, 0.3, 0.2, 0.25), cfg)
    assert not stopped(rows(0.1, 0.3, 0.2, 0.25), replace(cfg, patience=0))
    with pytest.raises(ValueError, match="heldout_top1"):  # a curve the evaluations never report
        stopped([{"heldout_h1_r0": 0.3}] * 4, cfg)
    with pytest.raises(ValueError, match="patience"):
        TrainConfig(patience=-1)
    with pytest.raises(ValueError, match="epochs"):
        TrainConfig(epochs=-1.0)


def test_fit_spends_the_budget_and_stops_when_agreement_stops_rising(store):
    from specref.training.eagle import EagleHead, EagleTask, EagleTrainConfig
    from specref.training.draft import build_token_map

    target = _target()
    train, held = store_split(store, heldout_fraction=0.2)
    nb = (len(train) + 7) // 8

    def run(cfg):
        head = EagleHead(target, build_token_map(train, V, V), seed=0)
        return fit(EagleTask(head, EagleTrainConfig(draft_vocab=V)), train, held, cfg, progress=False,
                   log=lambda *a: None)

    res = run(replace(TCFG, steps=1000, epochs=1.0, eval_every=2))
    assert res.steps == nb and not res.stopped_early and res.history[-1]["step"] == nb
    assert all("heldout_top1" in row for row in res.history)  # the agreement curve
    # a gain no run reaches: stops after `patience` evaluations past the first
    res = run(replace(TCFG, steps=1000, eval_every=2, patience=2, min_gain=2.0))
    assert res.stopped_early and res.steps == 4 and [r["step"] for r in res.history] == [0, 2, 4]


def test_the_record_states_the_budget_it_ran(store, tmp_path):
    """--epochs / --train-tokens replace --steps: the record's `steps` is the budget the run had,
    `steps_run` what it ran (fewer when the stopping rule ended it), as in the saved file."""
    import json
    from safetensors import safe_open
    from specref.training.eagle import EagleTrainConfig, run_eagle_store_training

    train, held = store_split(store, heldout_fraction=0.2)
    nb = (len(train) + 7) // 8
    cfg = replace(TCFG, steps=1000, epochs=2.0, eval_every=2)
    rec = run_eagle_store_training(_target(), train, held, cfg, EagleTrainConfig(draft_vocab=V),
                                   tmp_path / "e.safetensors")
    assert rec["train"]["steps"] == rec["train"]["steps_run"] == 2 * nb and not rec["stopped_early"]
    saved = json.loads(safe_open(str(tmp_path / "e.safetensors"), "pt").metadata()["record"])
    assert saved["train"]["steps"] == 2 * nb
    rec = run_eagle_store_training(_target(), train, held, replace(cfg, patience=2, min_gain=2.0),
                                   EagleTrainConfig(draft_vocab=V), tmp_path / "f.safetensors")
    assert rec["train"]["steps"] == 2 * nb and rec["train"]["steps_run"] == 4 and rec["stopped_early"]


def _head_runs(target, store, tmp_path):
    """name -> (train(init, out) -> first history row, evaluate(file) -> held-out top-1)."""
    from specref.draft_model import load_trained_draft
    from specref.eagle3 import load_eagle3
    from specref.eagle_head import load_eagle
    from specref.medusa_heads import load_medusa
    from specref.mtp import load_mtp
    from specref.training.draft import DraftDistillTask, DraftTrainConfig, run_draft_store_training
    from specref.training.eagle import EagleTask, EagleTrainConfig, run_eagle_store_training
    from specref.training.eagle3 import Eagle3Task, Eagle3TrainConfig, run_eagle3_training
    from specref.training.medusa import MedusaTask, MedusaTrainConfig, run_medusa_training
    from specref.training.mtp import MTPTask, MTPTrainConfig, run_mtp_training

    fin = store_split(store, heldout_fraction=0.2)
    e3 = store_split(store, layers=(0, 1, 2), heldout_fraction=0.2)
    lean = store_split(store, layers=(), heldout_fraction=0.2)
    q = dict(progress=False, log=lambda *a: None)
    ecfg, e3cfg = EagleTrainConfig(draft_vocab=V), Eagle3TrainConfig(draft_vocab=V, ttt_steps=2)
    mcfg, tcfg = MedusaTrainConfig(num_heads=2, draft_vocab=V), MTPTrainConfig(draft_vocab=V)
    ycfg = MedusaTrainConfig(num_heads=2, draft_vocab=V, sequential=True)
    pcfg = MedusaTrainConfig(num_heads=2, draft_vocab=V, sequential=True, prefix="attention")
    dcfg = DraftTrainConfig(num_layers=1, draft_vocab=48)
    return {
        "eagle": (lambda i, o: run_eagle_store_training(target, *fin, TCFG, ecfg, o, init=i)["history"][0],
                  lambda f: EagleTask(load_eagle(target, f)), fin[1]),
        "eagle3": (lambda i, o: run_eagle3_training(target, *e3, TCFG, e3cfg, o, layers=(0, 1, 2), init=i,
                                                    **q)[1].history[0],
                   lambda f: Eagle3Task(load_eagle3(target, f), e3cfg), e3[1]),
        "medusa": (lambda i, o: run_medusa_training(target, *fin, TCFG, mcfg, o, measure_costs=False,
                                                    init=i)["history"][0],
                   lambda f: MedusaTask(load_medusa(target, f), mcfg), fin[1]),
        "hydra": (lambda i, o: run_medusa_training(target, *fin, TCFG, ycfg, o, measure_costs=False,
                                                   init=i)["history"][0],
                  lambda f: MedusaTask(load_medusa(target, f), ycfg), fin[1]),
        "hydra_prefix": (lambda i, o: run_medusa_training(target, *fin, TCFG, pcfg, o, measure_costs=False,
                                                          init=i)["history"][0],
                         lambda f: MedusaTask(load_medusa(target, f), pcfg), fin[1]),
        "mtp": (lambda i, o: run_mtp_training(target, *fin, TCFG, tcfg, o, init=i, **q)[1].history[0],
                lambda f: MTPTask(load_mtp(target, f), tcfg), fin[1]),
        "draft": (lambda i, o: run_draft_store_training(target, *lean, TCFG, dcfg, o, init=i)["history"][0],
                  lambda f: DraftDistillTask(*load_trained_draft(target, f), V, dcfg.loss), lean[1]),
    }


@pytest.mark.parametrize("name", ["eagle", "eagle3", "medusa", "hydra", "hydra_prefix", "mtp", "draft"])
def test_init_continues_from_the_saved_head(name, store, tmp_path):
    """`train --method NAME --init FILE`: the run's first held-out evaluation is the saved head's."""
    torch.manual_seed(0)
    target = _target()
    train_fn, task_fn, held = _head_runs(target, store, tmp_path)[name]
    fresh = train_fn(None, tmp_path / "a.safetensors")  # 3 steps from a fresh head, saved
    first = train_fn(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    saved = evaluate(task_fn(tmp_path / "a.safetensors"), held, TCFG)
    held_first = {k[len("heldout_"):]: v for k, v in first.items() if k.startswith("heldout_")}
    assert held_first == pytest.approx(saved, abs=1e-6), (first, saved)  # agreement, loss, ...
    assert held_first != pytest.approx({k[len("heldout_"):]: v for k, v in fresh.items() if k.startswith("heldout_")},
                                       abs=1e-6)  # not a fresh head's


def test_a_continued_head_keeps_and_records_its_files_shape(store, tmp_path):
    """`--init FILE` with flags that name another shape (Medusa, MTP, the draft, EAGLE-3; EAGLE-1 in
    test_store.py): the run trains the file's heads and its record (and Medusa's per-head
    accuracies, which pick its tree) states the file's shape."""
    from specref.medusa_heads import load_medusa
    from specref.training.draft import DraftTrainConfig, run_draft_store_training
    from specref.training.medusa import MedusaTrainConfig, run_medusa_training
    from specref.training.mtp import MTPTrainConfig, run_mtp_training

    torch.manual_seed(0)
    target = _target()
    fin, lean = store_split(store, heldout_fraction=0.2), store_split(store, layers=(), heldout_fraction=0.2)
    q = dict(progress=False, log=lambda *a: None)
    run_medusa_training(target, *fin, TCFG, MedusaTrainConfig(num_heads=2, draft_vocab=V), tmp_path / "m.safetensors",
                        measure_costs=False)
    rec = run_medusa_training(target, *fin, TCFG, MedusaTrainConfig(num_heads=3, draft_vocab=32),
                              tmp_path / "m2.safetensors", measure_costs=False, init=tmp_path / "m.safetensors")
    assert (rec["medusa"]["num_heads"], rec["medusa"]["draft_vocab"], len(rec["heldout_top1"])) == (2, V, 2)
    # Hydra heads from a Medusa file, deepened by an identity ResBlock: the first --medusa-heads of its heads,
    # their first evaluation the file's
    rec = run_medusa_training(target, *fin, TCFG, MedusaTrainConfig(num_heads=1, sequential=True, num_layers=2),
                              tmp_path / "y.safetensors", measure_costs=False, init=tmp_path / "m.safetensors")
    assert (rec["medusa"]["num_heads"], rec["medusa"]["sequential"], rec["data"]["init_from"]) == (1, True, "medusa")
    assert (rec["medusa"]["num_layers"], rec["data"]["init_layers"]) == (2, 1)
    assert rec["history"][0]["heldout_h1_ce"] == pytest.approx(
        run_medusa_training(target, *fin, TCFG, MedusaTrainConfig(num_heads=1), tmp_path / "m3.safetensors",
                            measure_costs=False, init=tmp_path / "m.safetensors")["history"][0]["heldout_h1_ce"])
    # a prefix layer added to those Hydra heads starts as the identity: their first evaluation again
    rec2 = run_medusa_training(target, *fin, TCFG, MedusaTrainConfig(num_heads=1, sequential=True, prefix="layer"),
                               tmp_path / "y2.safetensors", measure_costs=False, init=tmp_path / "y.safetensors")
    assert (rec2["medusa"]["prefix"], rec2["data"]["prefix_added"]) == ("layer", "layer")
    assert rec2["history"][0]["heldout_h1_ce"] == pytest.approx(
        run_medusa_training(target, *fin, TCFG, MedusaTrainConfig(num_heads=1, sequential=True),
                            tmp_path / "y4.safetensors", measure_costs=False,
                            init=tmp_path / "y.safetensors")["history"][0]["heldout_h1_ce"])
    # each head's own trainable LM head, copied from the shared frozen one: the file's evaluation again
    rec3 = run_medusa_training(target, *fin, TCFG, MedusaTrainConfig(num_heads=1, sequential=True, own_lm_head=True),
                               tmp_path / "y5.safetensors", measure_costs=False, init=tmp_path / "y.safetensors")
    assert rec3["medusa"]["own_lm_head"] and rec3["data"]["lm_heads_untied"]
    assert rec3["history"][0]["heldout_h1_ce"] == pytest.approx(rec2["history"][0]["heldout_h1_ce"])
    assert load_medusa(target, tmp_path / "y5.safetensors").own_lm_head
    with pytest.raises(ValueError, match="has a prefix 'layer', not the 'attention' asked for"):
        run_medusa_training(target, *fin, TCFG, MedusaTrainConfig(num_heads=1, sequential=True, prefix="attention"),
                            tmp_path / "y3.safetensors", measure_costs=False, init=tmp_path / "y2.safetensors")
    # an EAGLE-1 head's file as the "eagle" prefix of those Hydra heads: one head more (head 1 the EAGLE
    # head's first draft), the EAGLE head's draft vocabulary, the prefix kept in the saved file
    from specref.training.eagle import EagleTrainConfig, run_eagle_store_training

    run_eagle_store_training(target, *fin, TCFG, EagleTrainConfig(draft_vocab=12), tmp_path / "e.safetensors")
    pcfg = MedusaTrainConfig(num_heads=3, sequential=True, prefix="eagle")
    rec4 = run_medusa_training(target, *fin, TCFG, pcfg, tmp_path / "y6.safetensors", measure_costs=False,
                               init=tmp_path / "y.safetensors", prefix_from=tmp_path / "e.safetensors")
    assert (rec4["medusa"]["num_heads"], rec4["medusa"]["prefix"], rec4["medusa"]["draft_vocab"]) == (2, "eagle", 12)
    assert rec4["data"]["prefix_from"] == "e.safetensors"
    y6 = load_medusa(target, tmp_path / "y6.safetensors")
    assert y6.prefix_kind == "eagle" and y6.num_heads == 2
    # --freeze-prefix: the heads train, the EAGLE head's tensors are saved as they came
    from specref.eagle_head import load_eagle

    rec5 = run_medusa_training(target, *fin, TCFG, replace(pcfg, freeze_prefix=True), tmp_path / "y8.safetensors",
                               measure_costs=False, init=tmp_path / "y.safetensors",
                               prefix_from=tmp_path / "e.safetensors")
    e, y8 = load_eagle(target, tmp_path / "e.safetensors"), load_medusa(target, tmp_path / "y8.safetensors")
    kept, moved = dict(y8.prefix.named_parameters()), dict(y6.prefix.named_parameters())
    assert all(torch.equal(kept[n], q) for n, q in e.trainable())
    assert not all(torch.equal(moved[n], q) for n, q in e.trainable())
    start = load_medusa(target, tmp_path / "y.safetensors").blocks[0][0].linear.weight  # y8's head 2 started as it
    assert rec5["medusa"]["freeze_prefix"] and not torch.equal(y8.blocks[1][0].linear.weight, start)
    for bad in (dict(init=None), dict(init=tmp_path / "y.safetensors", cfg=replace(pcfg, prefix="layer"))):
        with pytest.raises(ValueError, match="prefix_from .* needs init"):
            run_medusa_training(target, *fin, TCFG, bad.get("cfg", pcfg), tmp_path / "y7.safetensors",
                                measure_costs=False, init=bad["init"], prefix_from=tmp_path / "e.safetensors")
    with pytest.raises(ValueError, match="already has a prefix 'layer'"):
        run_medusa_training(target, *fin, TCFG, pcfg, tmp_path / "y7.safetensors", measure_costs=False,
                            init=tmp_path / "y2.safetensors", prefix_from=tmp_path / "e.safetensors")
    run_mtp_training(target, *fin, TCFG, MTPTrainConfig(num_modules=1, draft_vocab=V), tmp_path / "t.safetensors", **q)
    run_mtp_training(target, *fin, TCFG, MTPTrainConfig(num_modules=2, draft_vocab=32), tmp_path / "t2.safetensors",
                     init=tmp_path / "t.safetensors", **q)
    from specref.weights import read_weights

    rec = json.loads(read_weights(tmp_path / "t2.safetensors", names=())[1]["record"])
    assert (rec["mtp"]["num_modules"], rec["mtp"]["draft_vocab"]) == (1, V)
    run_draft_store_training(target, *lean, TCFG, DraftTrainConfig(num_layers=1, draft_vocab=48),
                             tmp_path / "d.safetensors")
    rec = run_draft_store_training(target, *lean, TCFG, DraftTrainConfig(num_layers=2, draft_vocab=16),
                                   tmp_path / "d2.safetensors", init=tmp_path / "d.safetensors")
    assert (rec["draft"]["num_layers"], rec["draft"]["draft_vocab"]) == (1, 48)
    from specref.training.eagle3 import Eagle3TrainConfig, run_eagle3_training

    e3 = store_split(store, layers=(0, 1, 2), heldout_fraction=0.2)
    run_eagle3_training(target, *e3, TCFG, Eagle3TrainConfig(draft_vocab=V, ttt_steps=2), tmp_path / "e.safetensors",
                        layers=(0, 1, 2), **q)
    run_eagle3_training(target, *e3, TCFG, Eagle3TrainConfig(draft_vocab=32, ttt_steps=2), tmp_path / "e2.safetensors",
                        layers=(0, 1, 2), init=tmp_path / "e.safetensors", **q)
    assert json.loads(read_weights(tmp_path / "e2.safetensors", names=())[1]["record"])["eagle3"]["draft_vocab"] == V


@pytest.mark.parametrize("name", ["eagle", "eagle3", "medusa", "mtp", "draft"])
def test_every_head_reports_the_stopping_rules_curve(name, store, tmp_path):
    """Every head type's held-out evaluation reports `heldout_top1` (TrainConfig.stop_metric), so
    `--patience` acts on it; Medusa's is head 1's top-1."""
    torch.manual_seed(0)
    train_fn, _, _ = _head_runs(_target(), store, tmp_path)[name]
    first = train_fn(None, tmp_path / "a.safetensors")
    assert 0 <= first["heldout_top1"] <= 1, first
    if name == "medusa":
        assert first["heldout_top1"] == pytest.approx(first["heldout_h1_r0"])


def test_streamed_store_trains_like_in_memory(store, tmp_path):
    from specref.training.eagle import EagleTrainConfig, run_eagle_store_training
    from specref.training.store import StreamedStore, streamed_split

    mem = store_split(store, layers=("final", 1), heldout_fraction=0.2)
    lazy = streamed_split([store], layers=("final", 1), heldout_fraction=0.2)
    assert [len(x) for x in lazy] == [len(x) for x in mem] and not lazy[0]._open  # nothing read yet
    for a, b in zip(mem[0], lazy[0]):
        assert a.tokens.equal(b.tokens) and a.prompt_len == b.prompt_len and a.features.equal(b.features)
        assert a.topk_ids.equal(b.topk_ids) and a.topk_logprobs.equal(b.topk_logprobs)
    assert len(StreamedStore([store])) == len(mem[0]) + len(mem[1])
    mem = store_split(store, heldout_fraction=0.2)
    lazy = streamed_split([store], heldout_fraction=0.2)
    cfg = replace(TCFG, steps=6, eval_every=2)
    runs = []
    for data in (mem, lazy):
        torch.manual_seed(0)
        runs.append(run_eagle_store_training(_target(), *data, cfg, EagleTrainConfig(draft_vocab=V),
                                             tmp_path / "e.safetensors")["history"])
    for a, b in zip(*runs):
        assert {k: v for k, v in a.items() if k != "seconds"} == {k: v for k, v in b.items() if k != "seconds"}


def test_levers_reach_their_settings(monkeypatch, tmp_path):
    """--w-reg/--w-cls, --ttt-steps, --draft-vocab, --epochs/--patience, --init, --stream reach the
    configs of the run (train) and --dtype the target that writes labels and features (data)."""
    import specref.models
    from specref.training import cli, eagle, eagle3, store

    seen = {}
    monkeypatch.setattr(cli, "_from_store", lambda a, name, frac, layers=("final",): (
        seen.update(stream=a.stream, name=name), None, [], [], tmp_path, {})[1:])
    monkeypatch.setattr(cli, "_export", lambda *a: None)
    monkeypatch.setattr(eagle, "run_eagle_store_training",
                        lambda t, tr, h, tc, c, o, **k: seen.update(train=tc, cfg=c, init=k["init"]))
    monkeypatch.setattr(eagle3, "run_eagle3_training",
                        lambda t, tr, h, tc, c, o, **k: seen.update(train=tc, cfg=c, init=k["init"]))
    cli.train_main(["--method", "eagle", "--store", "S", "--w-reg", "1.0", "--w-cls", "0.1", "--draft-vocab", "16384",
                    "--epochs", "20", "--patience", "3", "--min-gain", "0.005", "--init", "h.safetensors", "--stream"])
    assert (seen["cfg"].w_reg, seen["cfg"].w_cls, seen["cfg"].draft_vocab) == (1.0, 0.1, 16384)
    assert (seen["train"].epochs, seen["train"].patience, seen["train"].min_gain) == (20.0, 3, 0.005)
    assert seen["init"] == "h.safetensors" and seen["stream"]
    cli.train_main(["--method", "eagle3", "--store", "S", "--ttt-steps", "7", "--train-tokens", "5000000"])
    assert seen["cfg"].ttt_steps == 7 and seen["train"].tokens == 5_000_000 and seen["name"] == "eagle3_ttt7"
    assert not seen["stream"] and seen["init"] is None
    from specref.training import mtp as mtp_training

    monkeypatch.setattr(mtp_training, "run_mtp_training",
                        lambda t, tr, h, tc, c, o, **k: seen.update(train=tc, cfg=c, init=k["init"]))
    cli.train_main(["--method", "mtp", "--store", "S", "--mtp-modules", "2", "--mtp-lambda", "0.1", "--mtp-w-reg", "1",
                    "--mtp-current-token"])
    assert (seen["cfg"].num_modules, seen["cfg"].lam, seen["cfg"].w_reg) == (2, 0.1, 1.0) and seen["cfg"].current_token
    cli.train_main(["--method", "mtp", "--store", "S"])
    assert (seen["cfg"].lam, seen["cfg"].w_reg) == (1.0, 0.0)  # the report's objective by default
    assert not seen["cfg"].current_token  # and the report's inputs
    from specref.training import medusa as medusa_training

    monkeypatch.setattr(medusa_training, "run_medusa_training",
                        lambda t, tr, h, tc, c, o, **k: seen.update(train=tc, cfg=c, init=k["init"],
                                                                   prefix_from=k["prefix_from"]))
    cli.train_main(["--method", "medusa", "--store", "S", "--hydra", "--medusa-heads", "2", "--init", "m.safetensors",
                    "--medusa-layers", "2"])
    assert seen["cfg"].sequential and seen["cfg"].num_heads == 2 and seen["init"] == "m.safetensors"
    assert seen["cfg"].num_layers == 2 and seen["cfg"].prefix is None
    cli.train_main(["--method", "medusa", "--store", "S", "--hydra", "--medusa-prefix", "attention"])
    assert seen["cfg"].prefix == "attention" and seen["prefix_from"] is None
    cli.train_main(["--method", "medusa", "--store", "S", "--hydra", "--medusa-prefix", "eagle", "--init", "y.safetensors",
                    "--prefix-from", "e.safetensors"])
    assert seen["cfg"].prefix == "eagle" and seen["prefix_from"] == "e.safetensors" and not seen["cfg"].freeze_prefix
    cli.train_main(["--method", "medusa", "--store", "S", "--hydra", "--medusa-prefix", "eagle", "--freeze-prefix"])
    assert seen["cfg"].freeze_prefix
    cli.train_main(["--method", "medusa", "--store", "S"])
    assert not seen["cfg"].sequential

    class Stop(Exception):
        pass

    def load_default(dtype=None, device=None):
        seen["dtype"] = dtype
        raise Stop

    monkeypatch.setattr(specref.models, "load_default", load_default)
    for name in ("bfloat16", "float32"):
        with pytest.raises(Stop):
            store.data_main(["--out", str(tmp_path), "--dtype", name])
        assert seen["dtype"] == getattr(torch, name)


def test_loss_levers_take_effect(store):
    """The EAGLE-1 loss is w_reg * regression + w_cls * classification; a deeper training-time test
    (EAGLE-3 ttt_steps) is another loss."""
    from specref.training.draft import build_token_map
    from specref.training.eagle import EagleHead, EagleTask, EagleTrainConfig
    from specref.training.eagle3 import Eagle3Task, Eagle3TrainConfig
    from specref.eagle3 import Eagle3Head

    target = _target()
    train, _ = store_split(store, heldout_fraction=0.2)
    batch = collate(train[:8], 48)
    head = EagleHead(target, build_token_map(train, V, V), seed=0)

    def loss(**w):
        torch.manual_seed(0)  # the same input noise
        return float(EagleTask(head, EagleTrainConfig(draft_vocab=V, **w), seed=0).loss(batch).detach())

    reg, cls = loss(w_reg=1.0, w_cls=0.0), loss(w_reg=0.0, w_cls=1.0)
    assert loss(w_reg=1.0, w_cls=0.1) == pytest.approx(reg + 0.1 * cls, rel=1e-5)
    assert loss() == pytest.approx(reg + 0.1 * cls, rel=1e-5)  # the default: the EAGLE paper's weights
    assert loss(w_reg=0.5, w_cls=1.0) == pytest.approx(0.5 * reg + cls, rel=1e-5)
    e3 = store_split(store, layers=(0, 1, 2), heldout_fraction=0.2)[0]
    h3 = Eagle3Head(target, build_token_map(e3, V, V), layers=(0, 1, 2), seed=0)
    b3 = collate(e3[:8], 48)
    l3, l7 = (float(Eagle3Task(h3, Eagle3TrainConfig(draft_vocab=V, ttt_steps=n)).loss(b3).detach()) for n in (3, 7))
    assert l3 != pytest.approx(l7, rel=1e-4)


def test_mtp_feature_regression(store):
    """MTP's optional feature regression: loss = lam * mean_d CE_d + w_reg * mean_d reg_d, and depth
    d's regression target at position i is the target's own state at i + d (zero when the module's
    normed output is that state; not zero one position off)."""
    from specref.mtp import MTPStack
    from specref.training.draft import build_token_map
    from specref.training.mtp import MTPTask, MTPTrainConfig

    target = _target()
    train, _ = store_split(store, heldout_fraction=0.2)
    batch = collate(train[:8], 48)
    stack = MTPStack(target, build_token_map(train, V, V), num_modules=2, seed=0)

    def loss(**w):
        return float(MTPTask(stack, MTPTrainConfig(num_modules=2, draft_vocab=V, **w)).loss(batch).detach())

    ce = loss()
    reg = loss(w_reg=1.0) - ce
    assert reg > 0 and loss(lam=0.1, w_reg=1.0) == pytest.approx(0.1 * ce + reg, rel=1e-5)
    assert loss(lam=0.1, w_reg=2.0) == pytest.approx(0.1 * ce + 2 * reg, rel=1e-5)
    task = MTPTask(stack, MTPTrainConfig(num_modules=2, draft_vocab=V, w_reg=1.0))
    f = batch.features.float()  # (B, T, D)
    for layer in stack.layers:
        layer.norm = torch.nn.Identity()  # the module's normed output is what it is given
    for d in (1, 2):
        assert float(task._reg(d, f[:, d:], batch)) == 0.0
        assert float(task._reg(d, f[:, d - 1:-1], batch)) > 0.01
    with pytest.raises(ValueError, match="w_reg"):
        MTPTrainConfig(w_reg=-1.0)
    with pytest.raises(ValueError, match="lam"):
        MTPTrainConfig(lam=True)
