"""Offline analysis on top of the core: the benchmarks behind `dcp-opt bench` (one batch and
a stream of batches), what-if for a length distribution, and Gantt charts. Nothing in the
core imports this package; the CLI does."""
