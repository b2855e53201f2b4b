"""GPU benchmarks of the kernels, the decode step and the entry points: each script is one command, prints a table and writes JSON."""
