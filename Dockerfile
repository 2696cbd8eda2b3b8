# syntax=docker/dockerfile:1
# CPU image:  docker build -t batchgate:0.1.0 .
# GPU image:  see Dockerfile.cuda.
#
# Two stages. "build" installs the package and its wheels into a virtualenv; "runtime" starts
# again from the same slim base and receives only that virtualenv and the bundled models: no pip
# cache, no sources, no compilers (every dependency ships manylinux wheels, so none is needed).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/batchgate/venv
ENV PATH=/opt/batchgate/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml LICENSE ./
COPY batchgate ./batchgate
COPY proto ./proto
COPY gateway ./gateway
COPY workers ./workers
COPY cache ./cache
COPY bench ./bench
COPY client ./client
# A regular (not editable) install, so the runtime stage needs site-packages only. The checks
# fail the build if both onnxruntime wheels ended up here (each provides the same module) or if
# the server cannot import. -P: the sources' ./batchgate (here in WORKDIR) would otherwise shadow
# the installed package, whose batchgate.gateway it lacks.
RUN pip install ".[cpu]" \
 && ! pip show --quiet onnxruntime-gpu 2>/dev/null \
 && python -P -c "import batchgate.gateway.transport.server, batchgate.workers.engine, onnxruntime"

# The committed bundled models (ranker, encoder). minilm (text -> embedding) is not committed and
# is left out of the build context; BAKE_MINILM=true builds it here instead, deterministically
# from its pinned weights (downloaded at build time), because a pod never writes its repository.
COPY model_repository /opt/batchgate/model_repository
ARG BAKE_MINILM=false
RUN if [ "$BAKE_MINILM" = true ]; then batchgate prepare-minilm --out /opt/batchgate/model_repository; fi

FROM ${PYTHON_IMAGE} AS runtime
# Numeric uid/gid so Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
RUN groupadd --system --gid 10001 batchgate \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin batchgate
COPY --from=build /opt/batchgate/venv /opt/batchgate/venv
# The bundled models, read-only for the server (root-owned); a pod never writes its repository.
COPY --from=build /opt/batchgate/model_repository /opt/batchgate/model_repository
# Bytecode was compiled at install time; with a read-only root nothing could be written anyway.
ENV PATH=/opt/batchgate/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    BATCHGATE_MODEL_REPOSITORY=/opt/batchgate/model_repository \
    BATCHGATE_BUILD_BUNDLED_MODELS=false
WORKDIR /opt/batchgate
USER 10001:10001
EXPOSE 8001 8000
# For plain `docker run`; Kubernetes ignores this and uses the chart's gRPC probes.
# With TLS on (BATCHGATE_TLS_*), the plaintext BATCHGATE_METRICS_PORT answers it when set.
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s \
  CMD ["python", "-c", "import os, urllib.request; e = os.environ.get; urllib.request.urlopen('http://127.0.0.1:%s/v2/health/ready' % (e('BATCHGATE_METRICS_PORT') or e('BATCHGATE_HTTP_PORT', '8000')), timeout=2)"]
# The server is PID 1: it installs SIGTERM/SIGINT handlers (drain, then exit 0) and starts no
# child processes, so no init shim is needed.
ENTRYPOINT ["batchgate"]
CMD ["serve"]
