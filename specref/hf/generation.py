"""transformers' conventions at specref's boundary: GenerationConfig in, sequences out, stop strings.

People reach specref from `model.generate()`. This module turns what they pass there into
specref's settings, once, before the loop starts:
- `resolve()`: the settings of one call. Precedence, highest first: specref's keyword arguments,
  the generate-style `**kwargs` (GenerationConfig attribute names), the `generation_config`
  passed, the model's own `generation_config` (as transformers does), specref's defaults. A field
  that is unset everywhere takes specref's default, not transformers' global one: sampling at T=1
  with top-k off (transformers' unset do_sample means greedy and its top_k 50); pass
  do_sample=False or temperature=0 for greedy. `max_time` is transformers' MaxTimeCriteria, on
  the host clock after each step (on CUDA the host runs at most one step ahead of the device).
  Every setting specref does not implement (beam search, num_return_sequences > 1, contrastive
  search, typical_p, ...) is a ValueError naming it, never silently ignored.
- `StopStrings`: transformers' own `StopStringCriteria`, asked about every prefix of an accepted
  run, so a row stops exactly where `model.generate(stop_strings=...)` stops on the same text, even
  in the middle of a run of accepted drafts.
- `sequences()`: the output as `model.generate` returns it: the prompt as passed (with its
  padding), then the new tokens, each row padded with pad_token_id after its end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import checks
from . import processors


class _Unset:
    """The default of a keyword argument the caller did not pass (None is a value: e.g. no eos)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()

IMPLEMENTED = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
               "pad_token_id", "repetition_penalty", "no_repeat_ngram_size", "min_new_tokens",
               "bad_words_ids", "stop_strings", "max_time"}
# read and ignored: they change nothing about the tokens a decoder-only sampler returns
HARMLESS = {"bos_token_id", "decoder_start_token_id", "use_cache", "output_attentions", "output_hidden_states",
            "transformers_version", "_from_model_config", "cache_implementation", "cache_config", "max_cache_len",
            "compile_config", "disable_compile", "low_memory", "is_assistant", "renormalize_logits",
            "remove_invalid_values", "length_penalty", "early_stopping"}
# settings specref does not implement, allowed only at the value that switches them off
OFF = {"num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "diversity_penalty": 0.0,
       "penalty_alpha": 0.0, "typical_p": 1.0, "min_p": 0.0, "top_h": 1.0, "epsilon_cutoff": 0.0,
       "eta_cutoff": 0.0, "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0,
       "min_length": 0, "guidance_scale": 1.0, "output_scores": False, "output_logits": False,
       "return_dict_in_generate": False, "token_healing": False, "use_mtp": False}


@dataclass
class Settings:
    """One call's resolved settings."""

    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: Optional[int]  # None: from max_length once the prompt length is known
    max_length: Optional[int]
    eos: List[int]
    pad_token_id: Optional[int]
    procs: processors.Processors
    stop_strings: Optional[List[str]]
    max_time: Optional[float] = None  # seconds: no step starts after the call has run this long


def _config_values(cfg) -> Dict[str, Any]:
    """The set (non-None) fields of a GenerationConfig."""
    if cfg is None:
        return {}
    if not hasattr(cfg, "to_dict"):
        raise ValueError(f"generation_config must be a transformers GenerationConfig, got {type(cfg).__name__}")
    return {k: v for k, v in cfg.to_dict().items() if v is not None}


def _unsupported(values: Dict[str, Any]) -> List[str]:
    bad = []
    for k, v in values.items():
        if k in IMPLEMENTED or k in HARMLESS:
            continue
        if k in OFF and (v == OFF[k] or (OFF[k] == 0.0 and v is False)):
            continue
        bad.append(f"{k}={v!r}")
    return sorted(bad)


def resolve(model, generation_config, kwargs: Dict[str, Any], *, temperature, top_k, top_p, eos_token_id,
            max_new_tokens, pad_token_id, presence_penalty, frequency_penalty, logits_processor,
            stop_strings, vocab: int) -> Settings:
    """specref's settings for one call (see the module docstring for the precedence)."""
    from transformers import GenerationConfig

    known = set(GenerationConfig().to_dict())
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        raise ValueError(f"unknown generation settings {unknown}: pass specref's keyword arguments or "
                         "transformers GenerationConfig attributes")
    values = _config_values(getattr(model, "generation_config", None))
    values.update(_config_values(generation_config))
    values.update({k: v for k, v in kwargs.items() if v is not None})
    for name, arg in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                      ("eos_token_id", eos_token_id), ("max_new_tokens", max_new_tokens),
                      ("pad_token_id", pad_token_id), ("stop_strings", stop_strings)):
        if arg is not UNSET:
            values[name] = arg
    bad = _unsupported(values)
    if bad:
        raise ValueError(f"generation settings specref does not implement: {', '.join(bad)} (specref decodes one "
                         "sequence per prompt by sampling or greedy search; pass a generation_config without them)")
    if temperature is not UNSET:
        temp = checks.as_float(temperature, "temperature")
    elif values.get("do_sample") is False:
        temp = 0.0
    else:
        temp = checks.as_float(values.get("temperature", 1.0), "temperature")
    eos = checks.eos_ids(values.get("eos_token_id"), vocab)
    pad = values.get("pad_token_id")
    pad = None if pad is None else checks.as_int(pad, "pad_token_id", low=0)
    mnt = values.get("max_new_tokens")
    mnt = None if mnt is None else checks.as_int(mnt, "max_new_tokens", low=0)
    ml = values.get("max_length")
    ml = None if ml is None else checks.as_int(ml, "max_length", low=1)
    if mnt is None and ml is None:
        raise ValueError("pass max_new_tokens (or set max_new_tokens / max_length in the generation_config)")
    min_new = values.get("min_new_tokens")
    ngram = values.get("no_repeat_ngram_size")
    procs = processors.build(
        repetition_penalty=values.get("repetition_penalty"),
        presence_penalty=checks.as_float(presence_penalty, "presence_penalty"),
        frequency_penalty=checks.as_float(frequency_penalty, "frequency_penalty"),
        no_repeat_ngram_size=None if ngram is None else checks.as_int(ngram, "no_repeat_ngram_size", low=0),
        bad_words_ids=values.get("bad_words_ids"),
        min_new_tokens=None if min_new is None else checks.as_int(min_new, "min_new_tokens", low=0),
        eos=eos, logits_processor=logits_processor)
    stops = values.get("stop_strings")
    if isinstance(stops, str):
        stops = [stops]
    if stops is not None and (not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops)):
        raise ValueError(f"stop_strings must be a non-empty string or a list of them, got {stops!r}")
    max_time = values.get("max_time")
    if max_time is not None:
        max_time = checks.as_float(max_time, "max_time")
        if not max_time > 0:
            raise ValueError(f"max_time must be > 0 seconds, got {max_time!r}")
    return Settings(temp, checks.as_int(values.get("top_k", 0), "top_k"),
                    checks.as_float(values.get("top_p", 1.0), "top_p"), mnt, ml, eos, pad, procs,
                    list(stops) if stops else None, max_time)


class StopStrings:
    """Where each row's stop string completes, decided by transformers' StopStringCriteria."""

    def __init__(self, tokenizer, stop_strings: Sequence[str]):
        if tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: pass tokenizer=...")
        from transformers import StopStringCriteria

        self.criteria = StopStringCriteria(tokenizer=tokenizer, stop_strings=list(stop_strings))
        self.window = int(self.criteria.maximum_token_len) + 1  # tokens of context a match can span

    def first_stop(self, ctx_tokens: torch.Tensor, ctx_len: torch.Tensor, emitted: torch.Tensor,
                   num_emit: torch.Tensor):
        """-> (keep (B,), stopped (B,) bool): the number of this step's tokens each row keeps, up to
        and including the first token that completes a stop string (else num_emit), and whether one
        did. ctx_tokens (B, T) holds ctx_len tokens before the step's emitted (B, W) tokens."""
        keep = num_emit.clone()
        stopped = torch.zeros_like(num_emit, dtype=torch.bool)
        for b in range(emitted.shape[0]):
            n = int(num_emit[b])
            if n == 0:
                continue
            L = int(ctx_len[b])
            lo = max(L - self.window, 0)
            seq = torch.cat([ctx_tokens[b, lo:L], emitted[b, :n]]).cpu()  # (L - lo + n,)
            tails = [seq[: L - lo + j + 1] for j in range(n)]  # prefixes ending at each new token
            width = max(len(t) for t in tails)
            batch = torch.stack([torch.cat([t.new_zeros(width - len(t)), t]) for t in tails])  # (n, width)
            hit = self.criteria(batch, None)  # (n,) bool; reads only the last `window` tokens
            # a row shorter than the window: left zeros must not be read as text; recheck those
            for j in range(n):
                if bool(hit[j]) and len(tails[j]) < width and not bool(self.criteria(tails[j].view(1, -1), None)[0]):
                    hit[j] = False
            if bool(hit.any()):
                keep[b] = int(hit.float().argmax()) + 1
                stopped[b] = True
        return keep, stopped


def sequences(input_ids: torch.Tensor, new_tokens: torch.Tensor, num_tokens: torch.Tensor,
              pad_token_id: Optional[int]) -> torch.Tensor:
    """(B, T + n) as model.generate returns it: the prompt as passed, then each row's new tokens,
    padded with pad_token_id (n: the longest row's new tokens)."""
    if pad_token_id is None:
        raise ValueError("return_sequences needs pad_token_id (pass it, or set it in the generation_config)")
    ids = input_ids if input_ids.dim() == 2 else input_ids.view(1, -1)
    n = int(num_tokens.max()) if num_tokens.numel() else 0
    new = new_tokens[:, :n]
    new = torch.where(new >= 0, new, torch.full_like(new, pad_token_id))  # (B, n)
    return torch.cat([ids.to(new.device).long(), new], dim=1)
