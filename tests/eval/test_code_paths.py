"""The decode-step reading counter: it sees the package functions a step runs, and the step stays small."""

from __future__ import annotations

import json

from eval import code_paths

# The most (files, functions) each step may read: a ratchet. A change that makes a step read more
# raises it here and says why in its commit message.
MOST = {"dropin": (13, 69), "dropin_block_boundary": (14, 87), "generator": (25, 121)}


def test_each_step_is_counted_and_stays_within_todays_size(tmp_path):
    out = tmp_path / "paths.json"
    result = code_paths.main(["--out", str(out)])
    assert json.loads(out.read_text()) == result and set(result) == set(MOST)
    steady, boundary = result["dropin"]["paths"], result["dropin_block_boundary"]["paths"]
    assert "TieredBlockStore.save" in boundary["cache/store.py"]  # a full tail block goes to DRAM
    assert "TieredBlockStore.save" not in steady.get("cache/store.py", [])
    assert "sparse_decode_attention" in steady["attention.py"]  # past the budget: the sparse path
    assert "Generator.step" in result["generator"]["paths"]["generation/generator.py"]
    for name, (files, functions) in MOST.items():
        step = result[name]
        assert step["files"] == len(step["paths"]) and step["functions"] == sum(map(len, step["paths"].values()))
        spec = sum(len(names) for path, names in step["paths"].items() if path in code_paths.SPEC_FILES)
        assert 0 < step["spec_functions"] == spec < step["functions"]
        assert step["files"] <= files and step["functions"] <= functions, (name, step["files"], step["functions"])
