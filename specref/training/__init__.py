"""Training the learned proposers: the target's distribution p as the label, never a corpus's token.

    data.py      self-distillation data: the target's own answers, scored teacher-forced (top-k of p)
    loop.py      the shared loop: AdamW, schedule, clipping, held-out evaluation, exact resumption
    draft.py     the reduced-vocabulary draft model's task (KL to p) and its one command
    eagle.py     the EAGLE-1 head's task (feature regression + soft CE) and its one command
    evaluate.py  a trained draft measured side by side on Spec-Bench (tau, speed-up, parity)
    cli.py       `python -m specref train [--method draft|eagle] ...`

Method modules never import from here: they load their trained files through specref.weights.
"""
