"""Reading committed results: a file may be stored compressed (gzip or xz) beside its plain name;
and writing their plots small (`save_plot`).

Large raw outputs (per-sample JSON lines, diagnostics, serving runs) are committed as `NAME.gz` or,
where xz packs them much tighter, `NAME.xz`, to keep `eval/results/` small; every reader goes through
these helpers, so the runners keep writing plain files and a plain file is always read first.
"""

from __future__ import annotations

import gzip
import io
import json
import lzma
from pathlib import Path
from typing import Any

DECOMPRESS = {".gz": gzip.decompress, ".xz": lzma.decompress}  # suffix -> bytes -> bytes, in the order looked for


def stored(path: Path) -> Path | None:
    """`path` if it exists, else its first compressed sibling (`.gz`, then `.xz`) that exists, else None."""
    path = Path(path)
    if path.is_file():
        return path
    packed = (path.with_name(path.name + suffix) for suffix in DECOMPRESS)
    return next((p for p in packed if p.is_file()), None)


def read_text(path: Path) -> str:
    """The text of `path` or of a compressed sibling (FileNotFoundError naming `path` when none exists);
    a `path` named with its own `.gz` / `.xz` is read decompressed too."""
    found = stored(path)
    if found is None:
        raise FileNotFoundError(f"{path} (nor {Path(path).name}.gz or .xz beside it)")
    if found.suffix in DECOMPRESS:
        return DECOMPRESS[found.suffix](found.read_bytes()).decode("utf-8")
    return found.read_text(encoding="utf-8")


def read_json(path: Path) -> Any:
    """`json.loads` of `read_text(path)`."""
    return json.loads(read_text(path))


def read_jsonl(path: Path) -> list[Any]:
    """One JSON value per non-empty line of `read_text(path)`."""
    return [json.loads(line) for line in read_text(path).splitlines() if line.strip()]


def glob_stored(folder: Path, pattern: str) -> list[Path]:
    """Plain paths matching `pattern` in `folder`, counting compressed files as their plain names, sorted."""
    folder = Path(folder)
    plain = {p.name for p in folder.glob(pattern) if p.suffix not in DECOMPRESS}
    for suffix in DECOMPRESS:
        plain |= {p.name[: -len(suffix)] for p in folder.glob(pattern + suffix)}
    return [folder / name for name in sorted(plain)]


def save_plot(fig, path: Path, dpi: int = 120) -> None:
    """Save a matplotlib figure as a PNG of at most 256 colours: a plot of lines and markers looks the
    same, at about a quarter of the bytes of matplotlib's full-colour PNG (plots are committed)."""
    from PIL import Image  # matplotlib's own dependency

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=256).save(path, format="PNG", optimize=True)
