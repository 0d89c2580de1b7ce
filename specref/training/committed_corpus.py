"""The committed training corpus: the target's own answers as compressed token shards that last.

Drafts and heads learn the target's distribution p from what the target itself writes
(self-distillation: Medusa-2, Cai et al. 2024 Sec. 3.3; EAGLE, Li et al. 2024). Making those
answers is the dear part (the target generates them token by token), so they are kept in the
repository, in the top-level `corpus/` folder (not shipped in the installed package), and the
corpus grows by appending parts; the feature stores that training reads are rebuilt from it and
never committed.

Layout (format 1):
    corpus/manifest.json                      the model (name, fingerprint), every part, totals
    corpus/parts/NAME/answers_#####.safetensors.xz
                                              sequences as flat arrays, xz-compressed safetensors:
                                              `tokens` uint16 (sum L,), `offsets` int64 (S+1,),
                                              `prompt_lens` int32 (S,): prompt = tokens[:P], answer
                                              = tokens[P:] (the target's, through its chat template)
    corpus/parts/NAME/requests.jsonl.xz       the request texts that were answered (one JSON a line)
A part records how it was made (the data command, seed, dtype, temperature, answer length, what
wrote its requests, the data command's own manifest), its counts, a sha256 per file, and the
13-gram overlap of every request and every decoded sequence with each evaluation file it was
checked against (name, sha256, hits: a part with any hit is refused). Reading verifies the
checksums: a missing or corrupt file is a ValueError naming it.

Commands (`python -m specref corpus ...`):
    add DIR --name NAME --eval-file F ...   append a self-distilled folder (`python -m specref data
                                            --distilled DIR --self-instruct N ...`) as a new part
    verify                                  check every file against the manifest
    export --out DIR [--parts ..] [--fraction F] [--from-fraction F0]
                                            write a distilled folder (data.py's format) that
                                            `python -m specref data --sources --distilled DIR`
                                            scores into a feature store; --from-fraction keeps
                                            only what F adds to F0 (nested subsets)
    stats                                   counts per part
Left out: deduplication across parts (parts come from distinct seeds); parts for other models
(one corpus, one target: a part with another fingerprint is refused).
"""
from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch

from ..workloads import sha256_of as sha256
from .contamination import NGRAM, eval_ngrams, word_ngrams
from .data import FORMAT as DISTILLED_FORMAT
from .data import Seq, iter_sequences as folder_sequences, read_manifest, write_shard

FORMAT = 1  # bump when the layout changes
SHARD_SEQUENCES = 1024  # sequences per answers shard (~200k tokens, ~0.3 MB compressed)


# ----------------------------------------------------------------------------- shards


def write_answers(path, seqs: Sequence[Seq]) -> dict:
    """Write sequences as one xz-compressed safetensors shard; returns its record (counts, sha256)."""
    from safetensors.numpy import save

    lens = np.array([len(s.tokens) for s in seqs], dtype=np.int64)  # (S,)
    tokens = np.concatenate([s.tokens.numpy() for s in seqs])  # (sum L,)
    if tokens.min() < 0 or tokens.max() > np.iinfo(np.uint16).max:
        raise ValueError(f"token ids outside uint16 in {path}: this format holds vocabularies up to 65,536")
    arrays = {"tokens": tokens.astype(np.uint16),
              "offsets": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),  # (S+1,)
              "prompt_lens": np.array([s.prompt_len for s in seqs], dtype=np.int32)}  # (S,)
    blob = lzma.compress(save(arrays, metadata={"format": str(FORMAT)}), preset=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    P = int(arrays["prompt_lens"].sum())
    return {"sequences": len(seqs), "tokens": int(lens.sum()), "answer_tokens": int(lens.sum()) - P,
            "sha256": sha256(path)}


def read_answers(path) -> List[Seq]:
    """The sequences of one answers shard (no checksum here: `verify` checks the whole corpus)."""
    from safetensors.numpy import load

    t = load(lzma.decompress(Path(path).read_bytes()))
    off, P = t["offsets"].tolist(), t["prompt_lens"].tolist()
    tok = torch.from_numpy(t["tokens"].astype(np.int64))  # (sum L,)
    return [Seq(tok[off[i]: off[i + 1]].clone(), P[i]) for i in range(len(P))]


# ----------------------------------------------------------------------------- manifest


def read_corpus_manifest(root) -> dict:
    path = Path(root) / "manifest.json"
    if not path.is_file():
        raise ValueError(f"{root} holds no manifest.json: not a specref corpus (python -m specref corpus add ...)")
    man = json.loads(path.read_text())
    if man.get("format") != FORMAT:
        raise ValueError(f"{path}: corpus format {man.get('format')!r}, this specref reads {FORMAT}")
    return man


def _write_manifest(root: Path, man: dict) -> None:
    man["counts"] = {k: sum(p["counts"][k] for p in man["parts"]) for k in ("sequences", "tokens", "answer_tokens")}
    tmp = root / "manifest.json.tmp"
    tmp.write_text(json.dumps(man, indent=1) + "\n")
    tmp.replace(root / "manifest.json")


def _select(man: dict, parts: Optional[Sequence[str]]) -> List[dict]:
    names = [p["name"] for p in man["parts"]]
    if parts is None:
        return man["parts"]
    bad = [n for n in parts if n not in names]
    if bad:
        raise ValueError(f"parts {bad} are not in the corpus (it has {names})")
    return [p for p in man["parts"] if p["name"] in parts]


def verify(root, parts: Optional[Sequence[str]] = None) -> dict:
    """The manifest, after checking every file of the chosen parts against its sha256; ValueError
    naming each missing or corrupt file."""
    root = Path(root)
    man = read_corpus_manifest(root)
    bad = []
    for part in _select(man, parts):
        for f in part["files"]:
            path = root / f["path"]
            if not path.is_file():
                bad.append(f"{f['path']} is missing")
            elif sha256(path) != f["sha256"]:
                bad.append(f"{f['path']} is corrupt (sha256 differs from the manifest)")
    if bad:
        raise ValueError(f"corpus {root}: " + "; ".join(bad))
    return man


def _check_fractions(fraction: float, from_fraction: float) -> None:
    """ValueError unless 0 <= from_fraction < fraction <= 1 (the seeded slice iter_corpus keeps)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction={fraction}: expected 0 < fraction <= 1")
    if not 0.0 <= from_fraction < fraction:
        raise ValueError(f"from_fraction={from_fraction}: expected 0 <= from_fraction < fraction ({fraction})")


def iter_corpus(root, parts: Optional[Sequence[str]] = None, fraction: float = 1.0, seed: int = 0,
                check: bool = True, from_fraction: float = 0.0) -> Iterator[Seq]:
    """Every sequence of the chosen parts (checksums verified first), one shard in memory at a time;
    `fraction` < 1 keeps a seeded subset of each shard's sequences (the data curve's 1/4, 1/2).

    Each sequence draws r ~ U(0, 1) from its shard's seeded generator and is kept iff
    from_fraction <= r < fraction, so the subsets nest: fraction 1/2 is fraction 1/4 plus the slice
    from_fraction=1/4, fraction=1/2 (a data curve scores each sequence once)."""
    _check_fractions(fraction, from_fraction)
    root = Path(root)
    man = verify(root, parts) if check else read_corpus_manifest(root)
    for part in _select(man, parts):
        for f in part["files"]:
            if f["path"].endswith(".safetensors.xz"):
                seqs = read_answers(root / f["path"])
                if fraction < 1.0 or from_fraction > 0.0:
                    g = torch.Generator().manual_seed(seed * 1000003 + int(f["sha256"][:8], 16))
                    r = torch.rand(len(seqs), generator=g)  # (S,)
                    keep = (r >= from_fraction) & (r < fraction)  # (S,)
                    seqs = [s for s, k in zip(seqs, keep.tolist()) if k]
                yield from seqs


# ----------------------------------------------------------------------------- requests


def _requests(folder: Path) -> List[dict]:
    """The request rows the data command kept (self-instruct: requests_#####.json)."""
    rows = []
    for p in sorted(folder.glob("requests_*.json")):
        rows += json.loads(p.read_text())["rows"]
    return rows


# ----------------------------------------------------------------------------- append


def add_part(root, folder, name: str, eval_files: Sequence, tokenizer=None, command: str = "",
             shard_sequences: int = SHARD_SEQUENCES, model_name: str = "", drop_overlap: bool = False) -> dict:
    """Append a self-distilled folder (data.py's format) to the corpus as part `name`.

    Refused: a name already used, a folder for another model than the corpus's, no evaluation file
    to check against, or any word 13-gram shared with one (requests, and with `tokenizer` every
    decoded sequence). drop_overlap=True instead leaves out the requests and sequences that share
    one (counted in the manifest's overlap record: the part written has none). Returns the part's
    record (also written to the manifest)."""
    root, folder = Path(root), Path(folder)
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"name={name!r}: use letters, digits, '-' and '_'")
    if not eval_files:
        raise ValueError("eval_files is empty: pass the evaluation sets to check the part against "
                         "(e.g. Spec-Bench's question.jsonl: --eval-file, or set SPECREF_SPEC_BENCH)")
    src = read_manifest(folder)
    man = read_corpus_manifest(root) if (root / "manifest.json").is_file() else {
        "format": FORMAT, "model": {"name": model_name, "fingerprint": src.get("model_fingerprint")}, "parts": []}
    if any(p["name"] == name for p in man["parts"]):
        raise ValueError(f"the corpus already has a part {name!r}")
    if src.get("model_fingerprint") != man["model"]["fingerprint"]:
        raise ValueError(f"{folder} was written by model {src.get('model_fingerprint')}, the corpus holds "
                         f"model {man['model']['fingerprint']}'s answers")
    grams, checked = eval_ngrams(eval_files)
    requests = _requests(folder)
    seqs = list(folder_sequences(folder))
    texts = [r["instruction"] for r in requests]
    if tokenizer is not None:
        texts += tokenizer.batch_decode([s.tokens.tolist() for s in seqs], skip_special_tokens=True)
    hit = [not grams.isdisjoint(word_ngrams(t)) for t in texts]  # requests first, then sequences
    dropped = {"requests": sum(hit[: len(requests)]), "sequences": sum(hit[len(requests):])}
    if any(hit) and not drop_overlap:
        raise ValueError(f"{folder}: {sum(hit)} texts share a word {NGRAM}-gram with {[c['name'] for c in checked]}; "
                         "refused (pass drop_overlap=True / --drop-overlap to leave them out, or regenerate)")
    if any(hit):
        seq_hit = hit[len(requests):] if tokenizer is not None else [False] * len(seqs)
        requests = [r for r, h in zip(requests, hit) if not h]
        seqs = [s for s, h in zip(seqs, seq_hit) if not h]
    files = []
    for i in range(0, len(seqs), shard_sequences):
        rel = f"parts/{name}/answers_{i // shard_sequences:05d}.safetensors.xz"
        files.append({"path": rel, **write_answers(root / rel, seqs[i: i + shard_sequences])})
    rel = f"parts/{name}/requests.jsonl.xz"
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in requests)
    (root / rel).write_bytes(lzma.compress(body.encode("utf-8"), preset=9))
    files.append({"path": rel, "rows": len(requests), "sha256": sha256(root / rel)})
    settings = src.get("settings", {})
    part = {"name": name, "command": command, "seed": src.get("seed"), "dtype": src.get("dtype"),
            "temperature": settings.get("temperature"), "max_new_tokens": settings.get("max_new_tokens"),
            "generator": src.get("generator"),
            "requests_written_by": src.get("self_instruct", {}).get("method", "specref/data/instructions.jsonl"),
            "licence": "the target's own output (SmolLM2-135M-Instruct, Apache-2.0); requests written by the "
                       "target or by the project",
            "counts": {k: sum(f.get(k, 0) for f in files) for k in ("sequences", "tokens", "answer_tokens")},
            "overlap": {"n": NGRAM, "unit": "word (lower-cased \\w+ runs)", "checked_against": checked,
                        "texts_checked": len(texts), "hits": 0, "decoded_sequences": tokenizer is not None,
                        "dropped": dropped},
            "files": files, "data_manifest": src}
    man["parts"].append(part)
    _write_manifest(root, man)
    return part


def export(root, out, parts: Optional[Sequence[str]] = None, fraction: float = 1.0, seed: int = 0,
           shard_size: int = 256, from_fraction: float = 0.0) -> dict:
    """Write the chosen sequences (iter_corpus's) as a distilled folder (data.py's shards and manifest)
    for `python -m specref data --sources --distilled OUT`; returns that manifest."""
    _check_fractions(fraction, from_fraction)  # before the folder is made (iter_corpus checks lazily)
    man = verify(root, parts)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: export into a new folder")
    out.mkdir(parents=True, exist_ok=True)
    buf: List[Seq] = []
    counts: Dict[str, int] = {"sequences": 0, "tokens": 0, "response_tokens": 0}
    n = 0
    for s in iter_corpus(root, parts, fraction, seed, check=False, from_fraction=from_fraction):
        buf.append(s)
        counts["sequences"] += 1
        counts["tokens"] += len(s.tokens)
        counts["response_tokens"] += len(s.tokens) - s.prompt_len
        if len(buf) == shard_size:
            write_shard(out / f"shard_{n:05d}.safetensors", buf)
            buf, n = [], n + 1
    if buf:
        write_shard(out / f"shard_{n:05d}.safetensors", buf)
        n += 1
    dman = {"format": DISTILLED_FORMAT, "model_fingerprint": man["model"]["fingerprint"], "model": man["model"]["name"],
            "from_corpus": {"parts": [p["name"] for p in _select(man, parts)], "fraction": fraction,
                            "from_fraction": from_fraction, "seed": seed},
            "counts": counts, "shards": n}
    (out / "manifest.json").write_text(json.dumps(dman, indent=1))
    return dman


# ----------------------------------------------------------------------------- command line


def vocab_coverage(root, answers: Sequence[Sequence[int]], sizes: Sequence[int], vocab_size: int,
                   parts: Optional[Sequence[str]] = None, fraction: float = 1.0) -> Dict[int, float]:
    """{Vd: the share of the `answers`' tokens inside the draft vocabulary of size Vd that training
    would build from the corpus (draft.build_token_map: the Vd most frequent answer tokens)}: the
    ceiling that vocabulary puts on a head's agreement with the target on those answers."""
    from .draft import build_token_map

    toks = torch.tensor([t for a in answers for t in a], dtype=torch.long)  # (N,)
    if toks.numel() == 0:
        raise ValueError("no answer tokens to measure coverage on")
    if not sizes or any(not 2 <= int(v) <= vocab_size for v in sizes):
        raise ValueError(f"sizes must be draft vocabulary sizes in [2, {vocab_size}], got {list(sizes)}")
    # the map is a prefix of one frequency order (a stable sort), so one count serves every size
    order = build_token_map(list(iter_corpus(root, parts, fraction)), vocab_size, max(int(v) for v in sizes))
    out = {}
    for Vd in sizes:
        keep = torch.zeros(vocab_size, dtype=torch.bool)  # (V,)
        keep[order[: int(Vd)]] = True
        out[int(Vd)] = float(keep[toks].float().mean())
    return out


def bench_answers(path, method: str = "ar") -> List[List[int]]:
    """The generated token ids of one method's records in a bench JSON (`python -m specref bench`)."""
    b = json.loads(Path(path).read_text(encoding="utf-8"))
    recs = b.get("records", {}).get(method)
    if not recs or "tokens" not in recs[0]:
        raise ValueError(f"{path}: no {method!r} records with their tokens (the bench writes them; "
                         "benchmarks/ keeps them for 'ar' where a document says so)")
    return [r["tokens"] for r in recs]


def corpus_parser():
    """The command line of `python -m specref corpus` (rebuild.py checks its recipes against it)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m specref corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="corpus", help="the corpus folder (default: ./corpus)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("add", help="append a self-distilled folder as a new part")
    p.add_argument("folder")
    p.add_argument("--name", required=True)
    p.add_argument("--eval-file", nargs="+", default=None, help="evaluation JSONL files to check 13-gram overlap "
                   "with (default: $SPECREF_SPEC_BENCH; a part is never added unchecked)")
    p.add_argument("--command", default="", help="the data command that wrote the folder (recorded)")
    p.add_argument("--drop-overlap", action="store_true", help="leave out the requests and sequences that share "
                   "a 13-gram with an evaluation file (counted in the manifest) instead of refusing the part")
    sub.add_parser("verify", help="check every file against its sha256")
    p = sub.add_parser("export", help="write a distilled folder for `python -m specref data --distilled`")
    p.add_argument("--out", required=True)
    p.add_argument("--parts", nargs="*", default=None)
    p.add_argument("--fraction", type=float, default=1.0)
    p.add_argument("--from-fraction", type=float, default=0.0, help="keep only the seeded slice "
                   "[from_fraction, fraction): what --fraction F adds to --fraction F0 (same seed), so a data "
                   "curve's larger store is the smaller one plus this slice's store")
    p.add_argument("--seed", type=int, default=0)
    sub.add_parser("stats", help="counts per part")
    p = sub.add_parser("coverage", help="share of a bench run's answer tokens inside the draft vocabulary "
                       "that training builds from the corpus, per vocabulary size")
    p.add_argument("bench_json", nargs="+", help="bench JSONs whose 'ar' records are the target's answers")
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768, 49152])
    p.add_argument("--vocab-size", type=int, default=49152, help="the target's vocabulary (default: SmolLM2's)")
    p.add_argument("--parts", nargs="*", default=None,
                   help="the corpus parts to build the vocabulary from (default: all)")
    p.add_argument("--fraction", type=float, default=1.0)
    return ap


def corpus_main(argv=None) -> int:
    """`python -m specref corpus add | verify | export | stats | coverage`."""
    import time

    a = corpus_parser().parse_args(argv)
    t0 = time.perf_counter()
    if a.cmd == "add":
        from ..models import load_default

        _, tok = load_default()
        from .contamination import eval_files

        part = add_part(a.root, a.folder, a.name, eval_files(a.eval_file), tokenizer=tok, command=a.command,
                        model_name="SmolLM2-135M-Instruct (specref.load_default())", drop_overlap=a.drop_overlap)
        print(json.dumps({"part": a.name, "counts": part["counts"], "overlap": part["overlap"]["hits"]}))
    elif a.cmd == "verify":
        man = verify(a.root)
        print(json.dumps({"ok": True, "parts": len(man["parts"]), "counts": man["counts"]}))
    elif a.cmd == "export":
        dman = export(a.root, a.out, a.parts, a.fraction, a.seed, from_fraction=a.from_fraction)
        print(json.dumps({"out": a.out, "counts": dman["counts"], "seconds": round(time.perf_counter() - t0, 1)}))
    elif a.cmd == "coverage":
        answers = [t for f in a.bench_json for t in bench_answers(f)]
        cov = vocab_coverage(a.root, answers, a.sizes, a.vocab_size, a.parts, a.fraction)
        print(json.dumps({"answers": len(answers), "tokens": sum(map(len, answers)), "coverage": cov}))
    else:
        man = read_corpus_manifest(a.root)
        for part in man["parts"]:
            print(f"{part['name']}: {part['counts']}")
        print(f"all: {man['counts']}")
    return 0
