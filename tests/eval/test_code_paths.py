"""The decode-step reading counter: it sees the package functions a step runs, and the step stays small."""

from __future__ import annotations

import json

from eval import code_paths

# Today's counts (files, functions); a change that makes a step read more should say why, here.
# The selection (`attention.select_blocks`) and the 8-bit scales (`TieredBlockStore.scales_of`) are
# their own functions: attention over the resident blocks starts between the selection and the lookup.
# The position limit is one rule wherever it applies (`PositionLimit.has`), one call more per step.
# The metadata kind is one object (`scoring.SCORERS`) instead of string branches in the config, the
# store and the selection: one file more on every path, a scorer's call before the scoring op.
# A KV head's load cap is read from the config (`load_blocks`), and the selection's ranking keys are
# one function shared with the capped union (`reference.ranking_keys`): two calls more on every path.
# A decode step is launched and read back in two parts (`InFlightStep`, so that `decode_ahead` can
# launch the next one between them): one file more in the Generator's step.
# An iteration with no prefill work skips the prefill budget (`Generator._run_prefills` returns first).
# The selection granularity is one object (`scoring.SELECTIONS`) instead of string branches in the
# decode step, the scorer, the cache and admission: its pick is one call more on every path.
# The hand-off from the cache's update to the attention function is part of the forward's protocol
# (`forward_log`, beside its undo steps and checks), not a file of its own.
# The default channel scores read their metadata through ops/channels.py: one file more on every path.
MOST = {"dropin": (13, 72), "dropin_block_boundary": (14, 90), "generator": (25, 125)}


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
        assert step["files"] <= files and step["functions"] <= functions, (name, step["files"], step["functions"])
