"""The transports, one module per wire: gRPC (``grpc.py``, with its call takers in ``takers.py``),
KServe REST (``kserve_rest.py``), OpenAI (``openai.py``), TEI and rerank (``tei.py``) on the one
HTTP listener (``http.py``, with the fields the text wires share in ``fields.py`` and the OpenAPI
contract in ``openapi.py``), plaintext probes (``probes.py``), TLS for both (``tls.py``) and the
process lifecycle that owns the listeners and builds the door (``server.py``). They stay thin:
each translates its wire format, enters the door (gateway/admission/door.py) and calls the one
request pipeline (``gateway/infer.py``)."""
