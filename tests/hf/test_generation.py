"""hf/generation.py: transformers' conventions (GenerationConfig in, sequences out, stop strings, streamers, errors)."""
import copy

import pytest
import torch
from transformers import GenerationConfig, TextStreamer
from transformers.generation.streamers import BaseStreamer

from specref.draft_model import DraftModelConfig, DraftModelProposer
from specref.generate import autoregressive_generate, speculative_generate
from specref.models import load_default, tiny_model
from specref.ngram import NgramConfig, NgramProposer
from test_generate import _prompts

V = 64


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", vocab_size=V, seed=5)


def test_generation_config_and_kwargs_are_read(tiny):
    ids, mask = _prompts(V, [5, 9], seed=0)
    greedy = autoregressive_generate(tiny, ids, mask, max_new_tokens=10, temperature=0)
    cfg = GenerationConfig(do_sample=False, max_new_tokens=10)
    assert torch.equal(autoregressive_generate(tiny, ids, mask, generation_config=cfg).tokens, greedy.tokens)
    assert torch.equal(autoregressive_generate(tiny, ids, mask, max_new_tokens=10, do_sample=False).tokens,
                       greedy.tokens)  # generate-style kwargs
    # the keyword arguments win over the config: temperature 0.7 samples although do_sample=False
    s1 = autoregressive_generate(tiny, ids, mask, generation_config=cfg, temperature=0.7, seed=3)
    s2 = autoregressive_generate(tiny, ids, mask, max_new_tokens=10, temperature=0.7, seed=3)
    assert torch.equal(s1.tokens, s2.tokens)
    # max_length counts the (padded) prompt, as in transformers
    assert autoregressive_generate(tiny, ids, mask, max_length=ids.shape[1] + 4, do_sample=False).tokens.shape == (2, 4)
    # sampling settings from the config reach p: top_k 1 is greedy
    k1 = autoregressive_generate(tiny, ids, mask, generation_config=GenerationConfig(do_sample=True, top_k=1,
                                                                                     max_new_tokens=10), seed=0)
    assert torch.equal(k1.tokens, greedy.tokens)


def test_the_models_own_generation_config_is_the_default(tiny):
    ids, mask = _prompts(V, [5, 9], seed=0)
    greedy = autoregressive_generate(tiny, ids, mask, max_new_tokens=12, temperature=0)
    eos = greedy.row(1)[3]
    model = copy.copy(tiny)
    model.generation_config = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=eos)
    out = autoregressive_generate(model, ids, mask)  # greedy, 12 tokens, stops at eos
    for b in range(2):
        row = greedy.row(b)
        assert out.row(b) == (row[: row.index(eos) + 1] if eos in row else row)
    assert autoregressive_generate(model, ids, mask, eos_token_id=None).row(1) == greedy.row(1)  # None: no eos


@pytest.mark.parametrize("bad, name", [
    (dict(num_beams=4), "num_beams"), (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
    (dict(typical_p=0.9), "typical_p"), (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
    (dict(min_length=5), "min_length"), (dict(output_scores=True), "output_scores"),
])
def test_unsupported_settings_are_named(tiny, bad, name):
    ids, _ = _prompts(V, [5], seed=0)
    with pytest.raises(ValueError, match=name):
        autoregressive_generate(tiny, ids, max_new_tokens=4, **bad)
    with pytest.raises(ValueError, match=name):
        autoregressive_generate(tiny, ids, max_new_tokens=4, generation_config=GenerationConfig(**bad))
    model = copy.copy(tiny)
    model.generation_config = GenerationConfig(**bad)  # the model's own: named too
    with pytest.raises(ValueError, match=name):
        autoregressive_generate(model, ids, max_new_tokens=4)


def test_bad_generation_arguments(tiny):
    ids, _ = _prompts(V, [5], seed=0)
    with pytest.raises(ValueError, match="unknown generation settings"):
        autoregressive_generate(tiny, ids, max_new_tokens=4, not_a_setting=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        autoregressive_generate(tiny, ids)
    with pytest.raises(ValueError, match="GenerationConfig"):
        autoregressive_generate(tiny, ids, max_new_tokens=4, generation_config={"do_sample": False})
    with pytest.raises(ValueError, match="pad_token_id"):
        autoregressive_generate(tiny, ids, max_new_tokens=4, return_sequences=True)
    with pytest.raises(ValueError, match="tokenizer"):
        autoregressive_generate(tiny, ids, max_new_tokens=4, stop_strings=["ab"])
    with pytest.raises(ValueError, match="batch 1"):
        autoregressive_generate(tiny, _prompts(V, [3, 4], seed=0)[0], max_new_tokens=4, streamer=_Recorder())
    with pytest.raises(ValueError, match="repetition_penalty"):
        autoregressive_generate(tiny, ids, max_new_tokens=4, repetition_penalty=-1.0)


def test_max_time_ends_the_call_after_the_step_that_passes_it(tiny):
    """transformers' max_time (MaxTimeCriteria): no step starts once the call has run that long."""
    ids, mask = _prompts(V, [5, 9], seed=0)
    greedy = autoregressive_generate(tiny, ids, mask, max_new_tokens=12, temperature=0)
    one = autoregressive_generate(tiny, ids, mask, max_new_tokens=12, temperature=0, max_time=1e-9)
    assert one.num_tokens.tolist() == [1, 1] and one.stats.target_forwards == 1  # one step, then the clock
    assert one.row(0) == greedy.row(0)[:1] and one.row(1) == greedy.row(1)[:1]
    prop = NgramProposer(NgramConfig(k=4, min_n=1))
    spec = speculative_generate(tiny, prop, ids, mask, max_new_tokens=12, temperature=0, max_time=1e-9)
    assert spec.stats.target_forwards == 1
    assert all(spec.row(b) == greedy.row(b)[: len(spec.row(b))] for b in range(2))
    cfg = GenerationConfig(do_sample=False, max_new_tokens=12, max_time=1e-9)  # from a config too
    assert autoregressive_generate(tiny, ids, mask, generation_config=cfg).stats.target_forwards == 1
    long = autoregressive_generate(tiny, ids, mask, max_new_tokens=12, temperature=0, max_time=3600.0)
    assert torch.equal(long.tokens, greedy.tokens)
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="max_time"):
            autoregressive_generate(tiny, ids, mask, max_new_tokens=4, max_time=bad)


def test_sequences_as_model_generate_returns_them(tiny):
    ids, mask = _prompts(V, [4, 10, 7], seed=2)
    free = autoregressive_generate(tiny, ids, mask, max_new_tokens=12, temperature=0)
    eos = free.row(0)[4]  # row 0 ends early; the others (probably) run on
    hf = tiny.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                       pad_token_id=0)
    for prop in (None, DraftModelProposer(tiny, DraftModelConfig(k=3))):
        kw = dict(max_new_tokens=12, temperature=0, eos_token_id=eos, pad_token_id=0, return_sequences=True)
        out = (autoregressive_generate(tiny, ids, mask, **kw) if prop is None
               else speculative_generate(tiny, prop, ids, mask, **kw))
        assert torch.equal(out.sequences, hf)


class _Recorder(BaseStreamer):
    def __init__(self):
        self.puts = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.view(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_each_accepted_run(tiny):
    ids, _ = _prompts(V, [6], seed=1)
    rec = _Recorder()
    out = speculative_generate(tiny, DraftModelProposer(tiny, DraftModelConfig(k=4)), ids, max_new_tokens=14,
                               temperature=0, streamer=rec)
    assert rec.puts[0] == ids[0].tolist() and rec.ended  # the prompt first, as transformers does
    assert sum(rec.puts[1:], []) == out.row(0)
    assert len(rec.puts) - 1 == out.stats.target_forwards and max(map(len, rec.puts[1:])) > 1


@pytest.fixture(scope="module")
def real_vocab():
    """A tiny random model over the default model's real vocabulary and tokenizer."""
    _, tok = load_default()
    return tiny_model("llama", vocab_size=len(tok), seed=9), tok


def test_stop_strings_stop_where_transformers_stops(real_vocab, capsys):
    """A stop string spanning two tokens inside an accepted run (the target drafting for itself
    accepts every token): specref keeps the same tokens as model.generate(stop_strings=...)."""
    model, tok = real_vocab
    prompts = [tok("The weather today is", return_tensors="pt").input_ids[0],
               tok("Write a list of fruit:", return_tensors="pt").input_ids[0]]
    free = [autoregressive_generate(model, p, max_new_tokens=20, temperature=0).row(0) for p in prompts]
    pieces = [tok.decode([t]) for t in free[0]]
    i = next(i for i in range(3, 18) if pieces[i].strip().isalpha() and pieces[i + 1].strip().isalpha()
             and len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]  # ends inside token i + 1
    for p in prompts:
        hf = model.generate(input_ids=p.view(1, -1), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=20, do_sample=False, stop_strings=[stop, "zzqx"], tokenizer=tok,
                            pad_token_id=0)[0, len(p):].tolist()
        for prop in (DraftModelProposer(model, DraftModelConfig(k=5)), NgramProposer(NgramConfig(k=3, min_n=1))):
            out = speculative_generate(model, prop, p, max_new_tokens=20, temperature=0,
                                       stop_strings=[stop, "zzqx"], tokenizer=tok)
            assert out.row(0) == hf, (stop, type(prop).__name__)
    assert len(hf) < 20 or len(free[0]) > i + 2  # (the first prompt's row does stop at i + 1)
    first = speculative_generate(model, DraftModelProposer(model, DraftModelConfig(k=5)), prompts[0],
                                 max_new_tokens=20, temperature=0, stop_strings=stop, tokenizer=tok)
    assert first.num_tokens[0] <= i + 2 and stop in tok.decode(first.row(0))
    # the streamer's text is the decoded output
    capsys.readouterr()
    out = speculative_generate(model, DraftModelProposer(model, DraftModelConfig(k=5)), prompts[1],
                               max_new_tokens=20, temperature=0, streamer=TextStreamer(tok, skip_prompt=True))
    assert capsys.readouterr().out.rstrip("\n") == tok.decode(out.row(0))
