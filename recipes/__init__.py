"""Example recipes (jobs, sweeps, benchmarks, capacity plans) and their data, found by name."""
