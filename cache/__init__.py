"""Result cache (per-row keys, in-memory LRU, Redis, single-flight). Arrives with the cache issue;
the package exists now so the layout of DESIGN.md holds and gateway/ has a place to call into."""

__all__: list[str] = []
