"""GPU micro-benchmarks of the kernels (issue 3): each script is one command, prints a table and writes JSON."""
