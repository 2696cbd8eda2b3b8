"""Generated protocol modules (KServe v2 / Triton ``inference`` package; Hugging Face TEI's ``tei.v1``).

``POOL`` is the descriptor pool they register in; see ``proto/generate.py`` for why it is not
protobuf's default pool.
"""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
