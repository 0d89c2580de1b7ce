"""Published draft heads as their authors ship them, mapped onto specref's own head classes, so
every specref method that uses the head (chains, EAGLE-2 trees, hybrids, Medusa trees) runs on them:

- eagle.py: EAGLE-1/2 (Li et al., ICML 2024 / EMNLP 2024) and EAGLE-3 (Li et al. 2025) heads, with
  the head's own draft-layer shape and rotary embedding (rotary.py), as SafeAILab/EAGLE's inference
  builds them;
- medusa.py: Medusa-1 heads and the version-2 layout (Cai et al. 2024, FasterDecoding/Medusa);
- native.py: DeepSeek-V3's MTP layers and IBM's MLP speculators;
- files.py: the files themselves: safetensors, PyTorch pickles read weights-only (a pickle that
  would build anything but tensors is refused and runs nothing), sharded checkpoints (index files).

docs/published_heads.md has the name mappings and the parity table measured against the authors'
own code.
"""
from .eagle import PublishedEagle3Head, load_published_eagle, load_published_eagle3
from .files import PICKLE, is_published, read_checkpoint
from .medusa import load_published_medusa
from .native import load_native_mtp, load_published_mlp_speculator

__all__ = ["PICKLE", "PublishedEagle3Head", "is_published", "load_native_mtp", "load_published_eagle",
           "load_published_eagle3", "load_published_medusa", "load_published_mlp_speculator", "read_checkpoint"]
