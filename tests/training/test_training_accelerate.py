"""Data-parallel training through accelerate: 2 CPU processes equal 1 process on the same batches.

torch's launcher (`python -m torch.distributed.run --nproc_per_node 2`, what `accelerate launch`
uses for several GPUs; accelerate's own multi-CPU launch needs mpirun) runs
tests/training/ddp_fit.py with ACCELERATE_USE_CPU=1, so accelerate's process state is 2 CPU
processes talking gloo on loopback;
each process trains on half of every step's 4 sequences and the gradients are summed, weighted by
each half's share of the loss positions. The weights after 4 AdamW steps and the held-out loss
history must equal the in-process single-process run within float tolerance; checkpoints come from
the main process only.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def test_two_processes_equal_one(tmp_path):
    sys.path.insert(0, str(HERE))
    from ddp_fit import run

    one = run(str(tmp_path / "one"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(HERE.parents[1])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", "29517",
                           str(HERE / "ddp_fit.py"), str(tmp_path / "two")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-2000:]  # the main process alone reports
    two = json.loads(lines[0][len("RESULT "):])
    assert two["steps"] == one["steps"] == 4 and two["processes"] == 2 and one["processes"] == 1
    np.testing.assert_allclose(two["weights"], one["weights"], rtol=1e-4, atol=1e-6)
    for a, b in zip(one["history"], two["history"]):
        assert a["step"] == b["step"]
        np.testing.assert_allclose(b["heldout_loss"], a["heldout_loss"], rtol=1e-4)
        if a["train_loss"] is not None:
            np.testing.assert_allclose(b["train_loss"], a["train_loss"], rtol=1e-4)
    assert (tmp_path / "two" / "checkpoint.safetensors").is_file()
    # and training changed the weights (the comparison is not between two untouched inits)
    assert one["history"][-1]["heldout_loss"] < one["history"][0]["heldout_loss"]
