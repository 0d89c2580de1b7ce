"""Nothing in the repository depends on, or records, where one machine keeps its files; (c) the
tracked tree stays under 45 MB.

(a) The library never reaches outside its checkout for data: no `shared/` folder beside the
repository, no walking up past the package (`parents[3]`), no home, work or temp folder. (System
package locations that the training sources document, such as /usr/share/doc, are install
locations, not paths of a machine, and are allowed.)
(b) No committed result, manifest or document names an absolute path of the machine that wrote it:
a prompt file is named by its name (and sha256), the model by its name and fingerprint.
"""
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MACHINE = re.compile(r"(?<![\w.<>-])/(?:root|home|work|tmp|Users|mnt|scratch)/[\w.-]")
OUTSIDE = re.compile(r"shared/data|\.\./shared|parents\[[3-9]\]")


def _tracked(*patterns) -> list:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / p for p in out.stdout.split()]


def _hits(paths, pattern) -> list:
    bad = []
    for p in paths:
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{p.relative_to(REPO)}:{i}: {line.strip()[:120]}")
    return bad


def test_the_library_has_no_path_outside_the_repository():
    code = _tracked("specref/*.py", "specref/**/*.py")
    assert code
    bad = _hits(code, OUTSIDE) + _hits(code, MACHINE)
    assert not bad, "paths outside the repository in specref/:\n" + "\n".join(bad)


def test_no_committed_result_names_a_machine_path():
    files = _tracked("*.json", "*.jsonl", "*.md", "*.ipynb")
    assert any(p.parts[-2] == "benchmarks" or "benchmarks" in p.parts for p in files)
    bad = _hits(files, MACHINE)
    assert not bad, f"{len(bad)} absolute machine paths in committed files:\n" + "\n".join(bad[:20])


def test_the_patterns_themselves():
    assert MACHINE.search('"question_file": "/work/shared/data/spec_bench/question.jsonl"')
    assert MACHINE.search('"model": "/root/.cache/specref/SmolLM2"') and MACHINE.search("--out /tmp/x")
    assert not MACHINE.search('"model": "SmolLM2-135M-Instruct-3403c89dd44dfe2a"')
    assert not MACHINE.search("<specref cache>/store and /usr/share/doc/python3.11 and a/tmp/b")
    assert OUTSIDE.search('Path(__file__).parents[3] / "shared" / "data"') and not OUTSIDE.search("parents[1]")


def test_no_committed_weight_file_names_a_machine_path():
    """The metadata of every committed weight file (its training record: the stores it read, the
    files it started from) is inside the file, xz-compressed, where the text scan above cannot see it."""
    from specref.weights import read_weights

    files = _tracked("specref/weights/*.safetensors*")
    assert files
    bad = [f"{p.name}: {m.group(0)}" for p in files for m in [MACHINE.search(str(read_weights(p, names=())[1]))] if m]
    assert not bad, "machine paths in the metadata of committed weight files:\n" + "\n".join(bad)


def test_the_tracked_tree_stays_under_45_mb():
    """Weights and the corpus are committed, so every new file is paid for by every clone: the
    tracked files (git ls-files) stay under 45 MB (10^6 bytes) in all."""
    paths = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    total = sum((REPO / p.decode()).stat().st_size for p in paths if p and (REPO / p.decode()).is_file())
    assert 1_000_000 < total < 45_000_000, f"{total / 1e6:.1f} MB tracked"
