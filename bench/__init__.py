"""Benchmarks. Each prints its figures as ratios measured in one run (the machine is shared)."""
