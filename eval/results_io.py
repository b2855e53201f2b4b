"""Reading committed results: a file may be stored gzip-compressed beside its plain name.

Large raw outputs (per-sample JSON lines, diagnostics, serving runs) are committed as `NAME.gz` to
keep `eval/results/` small; every reader goes through these helpers, so the runners keep writing
plain files and a plain file is always read first.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any


def stored(path: Path) -> Path | None:
    """`path` if it exists, else its `.gz` sibling if that exists, else None."""
    path = Path(path)
    if path.is_file():
        return path
    packed = path.with_name(path.name + ".gz")
    return packed if packed.is_file() else None


def read_text(path: Path) -> str:
    """The text of `path` or of its `.gz` sibling (FileNotFoundError naming `path` when neither exists)."""
    found = stored(path)
    if found is None:
        raise FileNotFoundError(f"{path} (nor {Path(path).name}.gz beside it)")
    if found.suffix == ".gz" and found != Path(path):
        return gzip.decompress(found.read_bytes()).decode("utf-8")
    return found.read_text(encoding="utf-8")


def read_json(path: Path) -> Any:
    """`json.loads` of `read_text(path)`."""
    return json.loads(read_text(path))


def read_jsonl(path: Path) -> list[Any]:
    """One JSON value per non-empty line of `read_text(path)`."""
    return [json.loads(line) for line in read_text(path).splitlines() if line.strip()]


def glob_stored(folder: Path, pattern: str) -> list[Path]:
    """Plain paths matching `pattern` in `folder`, counting `.gz` files as their plain names, sorted."""
    folder = Path(folder)
    plain = {p.name for p in folder.glob(pattern) if p.suffix != ".gz"}
    plain |= {p.name[: -len(".gz")] for p in folder.glob(pattern + ".gz")}
    return [folder / name for name in sorted(plain)]
