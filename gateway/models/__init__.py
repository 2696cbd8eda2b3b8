"""Offline model preparation: the bundled ``ranker`` and ``encoder`` (``bundled_models``), the
MiniLM text model (``minilm``) and the ONNX graph builder they share (``onnx_graph``).

Nothing on the serving path imports this package: only the CLI (``batchgate build-models``,
``batchgate prepare-minilm``, and ``batchgate serve`` filling an empty repository), the tests
and the benches do. The builders pin their opset and IR version and are deterministic, so a
rebuild writes the committed model files byte for byte.
"""
