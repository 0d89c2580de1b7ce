"""The devices of the device-parametrized tests: the CPU always, CUDA where torch sees a GPU.

On a CPU-only machine (CI) these tests run on the CPU and nothing is skipped; on a GPU machine the
same tests run on both (`scripts/gpu_check.sh` selects them with `-m devices`)."""
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
