"""Tests of training/loop.py, data.py and draft.py (and draft_model.load_trained_draft): shards, the loop, resumption, parity."""
import math

import pytest
import torch

from specref.training.data import Seq, collate, read_shard, teacher_topk, write_shard
from specref.models import tiny_model
from specref.training.loop import TrainConfig, batch_indices, fit, load_checkpoint, lr_at, split_heldout
from specref.draft_model import build_draft
from specref.training.draft import DraftDistillTask, build_token_map

V = 64


def _target():
    # peaked, context-dependent next-token distributions (models.tiny_model's recommendation)
    m = tiny_model("llama", vocab_size=V, num_layers=2, seed=3, init_std=0.2, logit_scale=2.0)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def _data(target, n=48, seed=0):
    """Sequences sampled from the target itself: a 4-token random prompt, 20 response tokens."""
    from specref.generate import autoregressive_generate

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, V, (n, 4), generator=g)  # (n, 4)
    out = autoregressive_generate(target, prompts, max_new_tokens=20, temperature=1.0, seed=seed)
    seqs = [Seq(torch.cat([prompts[i], out.tokens[i]]), 4) for i in range(n)]
    batch = collate(seqs)
    ids, logp = teacher_topk(target, batch, 16)  # (n, 24, 16)
    for i, s in enumerate(seqs):
        s.topk_ids, s.topk_logprobs = ids[i, 3:23], logp[i, 3:23].half().float()
    return seqs


def _task(target, train):
    torch.manual_seed(0)
    token_map = build_token_map(train, V, 48)  # a reduced draft vocabulary: 48 of 64 tokens
    draft = build_draft(target, 1, token_map)
    return DraftDistillTask(draft, token_map, V, "kl", target=target, topk=16)


def test_collate_marks_response_positions():
    seqs = [Seq(torch.tensor([5, 6, 7, 8, 9]), 2),  # prompt 5 6, response 7 8 9: positions 1..3 predict it
            Seq(torch.tensor([1, 2, 3]), 1)]  # prompt 1, response 2 3: positions 0..1
    b = collate(seqs)
    assert b.tokens.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]]
    assert b.attention.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    assert b.loss_mask.tolist() == [[False, True, True, True, False], [True, True, False, False, False]]
    assert b.topk_ids is None


def test_teacher_topk_in_row_chunks_equals_one_pass():
    """A batch whose (B, T, V) logits exceed `max_logits` runs in row chunks (here one row at a
    time): the same top-k, with memory bounded whatever the batch's prompt lengths."""
    target = _target()
    g = torch.Generator().manual_seed(1)
    seqs = [Seq(torch.randint(0, V, (n,), generator=g), 2) for n in (9, 5, 12, 7, 3)]
    batch = collate(seqs)  # (5, 12)
    ids, logp = teacher_topk(target, batch, 8)  # one pass: 5 x 12 x 64 values
    ids1, logp1 = teacher_topk(target, batch, 8, max_logits=12 * V)  # one row per pass
    assert ids1.shape == ids.shape == (5, 12, 8)
    assert torch.equal(ids1, ids) and torch.allclose(logp1, logp, atol=1e-5)


def test_shard_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    seqs = [Seq(torch.randint(0, 50000, (L,), generator=g), P,
                torch.randint(0, 50000, (L - P, 4), generator=g), torch.randn(L - P, 4, generator=g))
            for L, P in ((10, 3), (7, 7), (30, 12))]  # the middle one has an empty response
    write_shard(tmp_path / "shard_00000.safetensors", seqs)
    back = read_shard(tmp_path / "shard_00000.safetensors")
    assert len(back) == 3
    for a, b in zip(seqs, back):
        assert torch.equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len
        assert torch.equal(a.topk_ids, b.topk_ids)
        assert torch.equal(a.topk_logprobs.half().float(), b.topk_logprobs)  # stored as float16


def test_schedule_and_data_order():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, batch_size=4, seed=1)
    assert lr_at(0, cfg) == pytest.approx(0.1)  # first warm-up step: lr / warmup
    assert lr_at(9, cfg) == pytest.approx(1.0)  # warm-up ends at the peak
    assert lr_at(55, cfg) == pytest.approx(0.55)  # half-way through the cosine: (1 + 0.1) / 2
    assert lr_at(100, cfg) == pytest.approx(0.1)  # the floor
    # 20 sequences of lengths 0..19, 4 per step: 5 batches per epoch; steps 0..9 = 2 epochs
    lengths = list(range(20))
    idx = [batch_indices(s, lengths, cfg) for s in range(10)]
    assert sorted(sum(idx[:5], [])) == lengths and sorted(sum(idx[5:], [])) == lengths
    assert {frozenset(b) for b in idx[:5]} != {frozenset(b) for b in idx[5:]}  # new batches each epoch
    assert all(b == sorted(b) for b in idx)  # cut from length-sorted windows (here length = index)
    assert batch_indices(7, lengths, cfg) == idx[7]  # a pure function of the step


def test_training_reduces_heldout_loss_and_raises_agreement():
    target = _target()
    train, held = split_heldout(_data(target, 64), 0.25, seed=0)
    task = _task(target, train)
    cfg = TrainConfig(steps=40, batch_size=8, lr=3e-3, warmup_steps=4, eval_every=40, seed=0)
    res = fit(task, train, held, cfg, progress=False, log=lambda s: None)
    first, last = res.history[0], res.history[-1]
    assert first["step"] == 0 and last["step"] == 40
    assert last["heldout_loss"] < first["heldout_loss"] - 0.05, (first, last)
    assert last["heldout_top1"] > first["heldout_top1"], (first, last)
    assert last["heldout_accept"] > first["heldout_accept"], (first, last)
    assert 0 <= last["heldout_accept"] <= 1 and 0 <= last["heldout_top1"] <= 1


def test_on_the_fly_teacher_equals_stored_topk():
    target = _target()
    seqs = _data(target, 4)
    task = _task(target, seqs)
    stored = collate(seqs)
    bare = collate([Seq(s.tokens, s.prompt_len) for s in seqs])  # no stored top-k: the target computes it
    a, b = task.evaluate(stored), task.evaluate(bare)
    assert a["count"] == b["count"] == 4 * 20
    assert a["top1"] == b["top1"]
    assert math.isclose(a["loss"], b["loss"], rel_tol=2e-3)  # stored log-probs are float16


def test_resume_equals_uninterrupted(tmp_path):
    target = _target()
    train, held = split_heldout(_data(target, 24), 0.25, seed=0)
    cfg = TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup_steps=2, eval_every=3, checkpoint_every=3)
    quiet = dict(progress=False, log=lambda s: None)
    whole = _task(target, train)
    fit(whole, train, held, cfg, out_dir=tmp_path / "a", **quiet)
    part = _task(target, train)
    fit(part, train, held, cfg, out_dir=tmp_path / "b", stop_after=3, **quiet)  # interrupted at step 3
    resumed = _task(target, train)  # a fresh process: new module, state from the checkpoint
    res = fit(resumed, train, held, cfg, out_dir=tmp_path / "b", **quiet)
    assert res.steps == 6
    for (n, p), (_, q) in zip(whole.named_trainable(), resumed.named_trainable()):
        assert torch.equal(p, q), n
    fresh = _task(target, train)
    step, history = load_checkpoint(tmp_path / "b" / "checkpoint.safetensors", fresh,
                                    torch.optim.AdamW([p for _, p in fresh.named_trainable()]))
    assert step == 6 and [h["step"] for h in history] == [0, 3, 6]


def test_draft_shares_frozen_embedding_and_maps_vocab():
    target = _target()
    token_map = torch.arange(V - 1, V - 17, -1)  # draft token i is target id 63 - i
    draft = build_draft(target, 1, token_map)
    assert draft.model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert not draft.model.embed_tokens.weight.requires_grad
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight[token_map])  # (16, D)
    assert draft(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 16)
    with pytest.raises(ValueError, match="num_layers"):
        build_draft(target, 3, token_map)


def test_greedy_parity_with_trained_draft():
    from specref.training.data import chat_prompt_ids
    from specref.draft_model import DraftModelConfig, DraftModelProposer
    from specref.generate import autoregressive_generate, speculative_generate
    from specref.models import load_default
    from specref.draft_model import WEIGHTS, load_trained_draft

    if not WEIGHTS.is_file():
        pytest.fail(f"the committed trained draft {WEIGHTS} is missing")
    target, tok = load_default()
    draft, token_map = load_trained_draft(target)
    for prompt in ("Write a Python function that adds two numbers.",):
        ids = torch.tensor([chat_prompt_ids(tok, prompt)])  # (1, T)
        base = autoregressive_generate(target, ids, max_new_tokens=32, temperature=0.0)
        prop = DraftModelProposer(draft, DraftModelConfig(k=4), token_map=token_map, vocab_size=49152)
        spec = speculative_generate(target, prop, ids, max_new_tokens=32, temperature=0.0)
        assert spec.row(0) == base.row(0)
        assert spec.stats.target_forwards < base.stats.target_forwards  # the draft is accepted at all


class _ByteTokenizer:
    """A stand-in tokenizer for distill(): ids are bytes + 2, the chat template wraps the text."""
    eos_token_id = 1
    pad_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        text = "<u>" + messages[0]["content"][:60] + "<a>"  # truncated: a tiny model has few positions
        return {"input_ids": [2 + b % 94 for b in text.encode()]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"w{i} " for i in ids if i > 1)  # ~4 characters per token


def test_distill_two_stages_and_resume(tmp_path):
    import json

    from specref.training.data import (DistillConfig, distill, iter_sequences, passage_instructions,
                                      shard_paths)

    model = tiny_model("llama", vocab_size=96, num_layers=1, seed=0, init_std=0.2, logit_scale=2.0)
    model.generation_config.eos_token_id = None
    inst = tmp_path / "inst.jsonl"
    inst.write_text("".join(json.dumps({"id": i, "category": "qa", "instruction": f"question {i}?"}) + "\n"
                            for i in range(6)))
    cfg = DistillConfig(max_new_tokens=60, batch_size=4, shard_size=4, topk=4, passage_prompts=5)
    man = distill(model, _ByteTokenizer(), tmp_path / "d", cfg, instructions_path=inst, progress=False)
    names = [p.name for p in shard_paths(tmp_path / "d")]
    assert names == ["shard_00000.safetensors", "shard_00001.safetensors",
                     "shard_p00000.safetensors", "shard_p00001.safetensors"]
    seqs = list(iter_sequences(tmp_path / "d"))
    assert man["counts"]["sequences"] == len(seqs) == 11
    assert all(len(q.tokens) - q.prompt_len == 60 and q.topk_ids.shape == (60, 4) for q in seqs)
    # the labels (the LM head at answer positions only, teacher.score) equal a full forward's top-k there
    ids, logp = teacher_topk(model, collate(seqs), 4)  # (11, T, 4)
    for j, q in enumerate(seqs):
        P, L = q.prompt_len, len(q.tokens)
        assert torch.equal(q.topk_ids, ids[j, P - 1: L - 1])
        assert torch.allclose(q.topk_logprobs.float(), logp[j, P - 1: L - 1], atol=1e-2)  # stored in fp16
    # the passage prompts quote first-stage answers (their first 60 characters survive the template)
    answers = [_ByteTokenizer().decode(q.tokens[q.prompt_len:].tolist()) for q in seqs[:6]]
    rows = passage_instructions(answers, 5, seed=0)
    assert len(rows) == 5 and all(any(a.strip() in r["instruction"] for a in answers) for r in rows)
    assert passage_instructions(answers, 5, seed=0) == rows  # deterministic
    # resuming keeps every shard and regenerates nothing
    stamps = [p.stat().st_mtime_ns for p in shard_paths(tmp_path / "d")]
    distill(model, _ByteTokenizer(), tmp_path / "d", cfg, instructions_path=inst, progress=False)
    assert [p.stat().st_mtime_ns for p in shard_paths(tmp_path / "d")] == stamps
    with pytest.raises(ValueError, match="other settings"):
        distill(model, _ByteTokenizer(), tmp_path / "d", DistillConfig(max_new_tokens=60, batch_size=4, shard_size=4,
                                                                        topk=4, passage_prompts=6),
                instructions_path=inst, progress=False)
    with pytest.raises(ValueError, match="at least 2 answers"):
        passage_instructions(["short"], 3)
    with pytest.raises(ValueError, match="passage_prompts"):
        DistillConfig(passage_prompts=-1)


def test_distill_refill_row_and_batch_answer_alike(tmp_path):
    """The answers' queue (DistillConfig.refill): a finished row taking the next prompt, or static
    batches, writes the same sequences at T > 0 (one generator per prompt); a bad name is refused."""
    import json

    from specref.training.data import DistillConfig, distill, iter_sequences

    model = tiny_model("llama", vocab_size=96, num_layers=1, seed=0, init_std=0.2, logit_scale=2.0)
    model.generation_config.eos_token_id = 40  # answers end at different steps: rows free up early
    inst = tmp_path / "inst.jsonl"
    inst.write_text("".join(json.dumps({"id": i, "category": "qa", "instruction": f"q {i}?"}) + "\n"
                            for i in range(7)))
    seqs = {}
    for refill in ("row", "batch"):
        cfg = DistillConfig(max_new_tokens=30, batch_size=3, shard_size=8, topk=0, temperature=1.0, refill=refill)
        distill(model, _ByteTokenizer(), tmp_path / refill, cfg, instructions_path=inst, progress=False)
        seqs[refill] = [q.tokens.tolist() for q in iter_sequences(tmp_path / refill)]
    assert seqs["row"] == seqs["batch"] and len(seqs["row"]) == 7
    assert len({len(x) for x in seqs["row"]}) > 1  # some answers ended early
    with pytest.raises(ValueError, match="refill"):
        DistillConfig(refill="never")


def test_distill_real_passage_stage(tmp_path):
    from specref.training.corpus import Doc, Source, passage_requests
    from specref.training.data import DistillConfig, distill, iter_sequences, shard_paths

    model = tiny_model("llama", vocab_size=96, num_layers=1, seed=0, init_std=0.2, logit_scale=2.0)
    model.generation_config.eos_token_id = None
    srcs = [Source("python-docs", "t", "t", [Doc("python-docs", f"d{i}", (("user", "x"), ("assistant", f"doc {i} "
                                                                                                   * 80)))
                                           for i in range(3)]),
            Source("debian-reference", "t", "t", [Doc("debian-reference", "de:0#0", (("user", "x"),
                                                                                      ("assistant", "Satz. " * 60)))])]
    passages = passage_requests(srcs, 5, seed=0)
    inst = tmp_path / "inst.jsonl"
    inst.write_text("")
    cfg = DistillConfig(max_new_tokens=8, batch_size=4, shard_size=4, topk=4, num_instructions=0, real_passages=5)
    with pytest.raises(ValueError, match="real_passages"):
        distill(model, _ByteTokenizer(), tmp_path / "d", cfg, instructions_path=inst, progress=False)
    man = distill(model, _ByteTokenizer(), tmp_path / "d", cfg, instructions_path=inst, progress=False,
                  passages=passages)
    assert [p.name for p in shard_paths(tmp_path / "d")] == ["shard_r00000.safetensors", "shard_r00001.safetensors"]
    assert man["counts"]["sequences"] == 5 and man["real_passages"] == passages[1]
    tok = _ByteTokenizer()
    for q, r in zip(iter_sequences(tmp_path / "d"), passages[0]):  # the prompt is the request, in the template
        assert q.tokens[: q.prompt_len].tolist() == list(tok.apply_chat_template(
            [{"role": "user", "content": r["instruction"]}], True, True, True)["input_ids"])
