"""Accuracy runners: LongBench v1's protocol on its real tasks, the RULER-style suite built offline from
real text, the block oracle, selection diagnostics and the report that joins them (each a `python -m`
command that writes its result file with the command, device and commit)."""
