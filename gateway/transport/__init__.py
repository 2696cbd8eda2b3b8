"""The transports: gRPC (``grpc.py``), REST (``rest.py``), TLS for both (``tls.py``) and the process
lifecycle that owns the listeners (``server.py``). They stay thin: each translates its wire format
and calls the one request pipeline (``gateway/infer.py``)."""
