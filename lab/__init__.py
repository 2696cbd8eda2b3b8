"""Lab equipment: profilers, one-off experiments and the benches behind figures in docs/, kept in the
checkout and out of the wheel (pyproject.toml maps no ``lab`` package). What a user runs is in bench/.

Run one from the checkout's root, with batchgate installed there (``make test`` does it)::

    .venv/bin/python -m lab.profile --targets noop,batchgate

Each builds on the shipped load generator (``batchgate.bench.loadgen``); a module here may import
another as ``lab.<name>``. tests/test_bench_tool.py imports every one, so a refactor that breaks
one shows in the suite.
"""
