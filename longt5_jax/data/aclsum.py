"""The embedded default task: ACLSum papers (Takeshita et al., 2024), summarised arXiv-style.

inputs = a paper's full body text (abstract excluded), targets = its abstract. The registry package
`aclsum` ships the files: `dataset/{train,val,test}.jsonl` name the papers of each split and
`dataset/paper_jsons/<id>.json` hold their S2ORC-style parses. The files are read directly; the
package itself is never imported (its helper class pulls in an unrelated dependency).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from longt5_jax.data.sources import DataError, Example

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")


def _dataset_dir() -> Path:
    """The package's data directory, found without importing the package."""
    spec = importlib.util.find_spec("aclsum")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("package 'aclsum' is not installed (pip install aclsum==0.1.2)")
    return Path(next(iter(spec.submodule_search_locations))) / "dataset"


def _paper_ids(split_file: Path) -> list[str]:
    ids = []
    with open(split_file, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                ids.append(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                message = f"{split_file}:{number}: expected a JSON object with 'id' ({e})"
                raise DataError(message) from e
    return ids


def _body_text(paragraphs: list[dict[str, Any]]) -> str:
    """Joins body paragraphs with newlines, each new section's heading on a line of its own."""
    # Headings cost a few tokens per section and mark where the introduction and conclusions are,
    # which is where abstract-worthy content concentrates (arXiv/PubMed keep section names for the
    # same reason). Paragraphs without a heading (captions, parse fragments) stay in the current
    # section, so returning to it does not repeat its heading.
    lines, section = [], ""
    for paragraph in paragraphs:
        text = (paragraph.get("text") or "").strip()
        heading = (paragraph.get("section") or "").strip()
        if not text:
            continue
        if heading and heading != section:
            lines.append(heading)
            section = heading
        lines.append(text)
    return "\n".join(lines)


def _paper_example(path: Path) -> tuple[str, str] | None:
    """A paper's (body text, abstract), or None when either is empty."""
    try:
        parse = json.loads(path.read_text(encoding="utf-8")).get("pdf_parse") or {}
    except FileNotFoundError as e:
        raise DataError(f"{path}: no such file (the paper is listed in a split)") from e
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise DataError(f"{path}: expected a JSON object with 'pdf_parse' ({e})") from e
    body = _body_text(parse.get("body_text") or [])
    texts = ((p.get("text") or "").strip() for p in parse.get("abstract") or [])
    abstract = "\n".join(t for t in texts if t)
    return (body, abstract) if body and abstract else None


@functools.cache
def _load_split(dataset_dir: Path, split: str) -> tuple[tuple[str, str], ...]:
    """Parses a split's papers once per process (about 100 papers, 12 MB of JSON)."""
    examples, skipped = [], 0
    for paper_id in _paper_ids(dataset_dir / f"{split}.jsonl"):
        example = _paper_example(dataset_dir / "paper_jsons" / f"{paper_id}.json")
        if example is None:
            skipped += 1
        else:
            examples.append(example)
    (log.warning if skipped else log.info)(
        "aclsum %s: %d papers, %d skipped for an empty body or abstract",
        split,
        len(examples),
        skipped,
    )
    return tuple(examples)


class AclSumSource:
    """One ACLSum split as {"inputs": body text, "targets": abstract}, parsed on first access."""

    def __init__(self, split: str):
        if split not in SPLITS:
            raise DataError(f"aclsum has no split {split!r} (splits: {', '.join(SPLITS)})")
        self._split = split
        self._dir = _dataset_dir()

    def _examples(self) -> tuple[tuple[str, str], ...]:
        # Only the split name and directory are pickled; each worker parses the papers itself.
        return _load_split(self._dir, self._split)

    def __len__(self) -> int:
        return len(self._examples())

    def __getitem__(self, index: int) -> Example:
        inputs, targets = self._examples()[index]
        return {"inputs": inputs, "targets": targets}

    def __repr__(self) -> str:
        return f"AclSumSource(split={self._split!r})"


def aclsum_source(split: str) -> AclSumSource:
    """The ACLSum split 'train', 'val' or 'test' as a grain random-access source."""
    return AclSumSource(split)
