# One image for the agent, the operator and the tools; the command picks which:
#   docker run IMAGE                         the agent (kvpool-agent, the default)
#   docker run IMAGE kvpool-operator -A      the operator (the Helm chart runs it so)
#   docker run IMAGE kvpool tenant-id SALT   a tool
# Build and push (README, "Container image"):
#   docker build -t REGISTRY/kvpool:0.1.0 . && docker push REGISTRY/kvpool:0.1.0
#
# The base is the Python the tests run on, pinned by tag and digest (update both together,
# e.g. from `docker buildx imagetools inspect python:3.11.7-slim-bookworm`).

FROM python:3.11.7-slim-bookworm@sha256:d11b9bd5e49ea7401753d78f4d3b56f3aec952b85b49bcae88981f0452818e0b AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
# the package's sources only (.dockerignore allows nothing else into the context)
COPY pyproject.toml README.md ./
COPY src ./src
RUN python -m venv /opt/kvpool \
 && /opt/kvpool/bin/pip install '.[all]' \
 && /opt/kvpool/bin/kvpool-agent --help > /dev/null \
 && /opt/kvpool/bin/kvpool-operator --help > /dev/null \
 && /opt/kvpool/bin/kvpool-csi --help > /dev/null \
 && /opt/kvpool/bin/kvpool-index --help > /dev/null \
 && /opt/kvpool/bin/kvpool-pd-sidecar --help > /dev/null \
 && /opt/kvpool/bin/kvpool --help > /dev/null

FROM python:3.11.7-slim-bookworm@sha256:d11b9bd5e49ea7401753d78f4d3b56f3aec952b85b49bcae88981f0452818e0b AS runtime
LABEL org.opencontainers.image.title="kvpool" \
      org.opencontainers.image.description="kvpool: node agent, vLLM connector library and Kubernetes operator of a managed KV cache for vLLM" \
      org.opencontainers.image.licenses="Apache-2.0"
# uid 10001: the agents' pods (the operator renders runAsUser 10001) and the chart's operator
RUN groupadd --system --gid 10001 kvpool \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/kvpool \
      --shell /usr/sbin/nologin kvpool \
 && install -d -o 10001 -g 10001 -m 0700 /var/lib/kvpool
# the virtual environment only: no compiler, no pip cache, no sources
COPY --from=build /opt/kvpool /opt/kvpool
ENV PATH=/opt/kvpool/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVPOOL_HOST=0.0.0.0 \
    KVPOOL_STATE_DIR=/var/lib/kvpool
USER 10001:10001
WORKDIR /var/lib/kvpool
# agent: ZMQ, HTTP API and metrics, chunk events; operator: liveness
EXPOSE 7400 7401 7402 8080
CMD ["kvpool-agent"]
