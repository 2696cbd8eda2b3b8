"""batchgate: a dynamic-batching inference gateway (KServe v2 / Triton gRPC and REST).

One distribution, one import namespace: ``batchgate.gateway``, ``batchgate.workers``,
``batchgate.cache``, ``batchgate.proto`` and ``batchgate.bench``. The repository keeps those
folders at its top level (go-style); ``pyproject.toml`` maps them under this package, so an
installed wheel never claims a bare ``proto`` or ``gateway`` (``proto-plus``, a dependency of every
google-cloud client, owns ``proto``).
"""

__version__ = "0.1.0"
