"""No lab-log wording in the tracked repository: results are named by what they measure.

What counts as a hit (the regexes below, case-insensitive):
- in every tracked text file: "session" or "sessions" followed by a number (space, hyphen or
  nothing between: "session <N>", "session-<N>", "sessions <N>-<M>") and "issue"/"issues" followed
  by a number ("issue <N>", "issue #<N>", "issues <N>-<M>");
- in Markdown files and notebooks: "session" at all, except `session()` (Target.session, an API
  name the documentation may cite); in code the bare word stays legitimate (Target.session, the
  pytest hook's `session` argument);
- in tracked paths: "session", or a lab tag `s<number>` as a path component or name part
  (`heads_s20/`, `*_s15.json`).
"""
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NUMBERED = re.compile(r"\b(sessions?[ -]?\d|issues?[ -]?#?\d)", re.IGNORECASE)
PROSE = re.compile(r"\bsessions?\b(?!\(\))", re.IGNORECASE)
PATH = re.compile(r"session|(^|[_/.-])s\d+($|[_/.-])", re.IGNORECASE)


def _tracked():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.decode().split("\0") if p]


def hits(path: str, text: str) -> list:
    """The offending lines of one file, as 'path:line: text'."""
    prose = path.endswith((".md", ".ipynb"))
    return [f"{path}:{i}: {line.strip()[:120]}" for i, line in enumerate(text.splitlines(), 1)
            if NUMBERED.search(line) or (prose and PROSE.search(line))]


def test_no_lab_wording_in_tracked_files():
    bad = [p for p in _tracked() if PATH.search(p)]
    for p in _tracked():
        f = REPO / p
        if not f.is_file() or f.stat().st_size > 2_000_000:
            continue
        data = f.read_bytes()
        if b"\0" in data[:4096]:  # binary
            continue
        bad += hits(p, data.decode("utf-8", errors="replace"))
    assert not bad, "lab-log wording (name results by what they measure):\n" + "\n".join(bad[:40])


@pytest.mark.parametrize("path,text,expected", [
    ("a.py", "# measured in sess" "ion 17", 1), ("a.py", "(iss" "ues 16-19)", 1), ("a.md", "iss" "ue #4 says", 1),
    ("a.py", "with tgt.session():", 0), ("a.md", "use `Target.session()`", 0), ("a.md", "this session ran", 1),
    ("a.py", "def pytest_collection_modifyitems(session, config, items):", 0), ("a.md", "see the issues page", 0),
])
def test_the_rule_itself(path, text, expected):
    assert len(hits(path, text)) == expected
