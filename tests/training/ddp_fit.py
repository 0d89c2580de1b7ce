"""A few steps of the shared training loop on a tiny draft task, run by test_training_accelerate.py
once in-process and once as 2 CPU processes (torch.distributed.run, gloo on loopback).
Prints the final loss and a checksum of the trained weights as JSON (main process only)."""
import json
import sys

import torch

from specref.draft_model import build_draft
from specref.models import tiny_model
from specref.training.data import Seq
from specref.training.draft import DraftDistillTask
from specref.training.loop import TrainConfig, fit


def run(out_dir=None):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    target = tiny_model("llama", vocab_size=48, seed=7, init_std=0.2, logit_scale=2.0)
    g = torch.Generator().manual_seed(1)
    seqs = []
    for i in range(16):  # ragged lengths: the processes' shares pad differently
        n = 10 + (i * 5) % 9
        toks = torch.randint(0, 48, (n,), generator=g)  # (n,)
        with torch.no_grad():
            logp = torch.log_softmax(target(input_ids=toks[None]).logits[0, 3:].float(), -1)  # (n-3, V)
        v, ids = logp.topk(8, dim=-1)  # (n-3, 8)
        seqs.append(Seq(tokens=toks, prompt_len=3, topk_ids=ids, topk_logprobs=v))
    token_map = torch.arange(0, 48, 2)  # (24,)
    draft = build_draft(target, 1, token_map)
    task = DraftDistillTask(draft, token_map, 48)
    cfg = TrainConfig(steps=4, batch_size=4, lr=3e-3, warmup_steps=1, eval_every=2, checkpoint_every=2)
    res = fit(task, seqs[:12], seqs[12:], cfg, out_dir=out_dir, progress=False, log=lambda *a: None)
    w = torch.cat([p.detach().flatten() for _, p in task.named_trainable()])  # (P,)
    from accelerate import PartialState

    return {"history": res.history, "weights": w[:4096].tolist(), "steps": res.steps,
            "processes": PartialState().num_processes}


if __name__ == "__main__":
    from accelerate import PartialState

    from specref.training.loop import close_processes

    result = run(sys.argv[1] if len(sys.argv) > 1 else None)
    if PartialState().is_main_process:
        print("RESULT " + json.dumps(result))
    close_processes()  # what `python -m specref train` does before exit
