# One image for the agent and the operator; the command picks which:
#   docker run IMAGE kvpool-agent        (the default)
#   docker run IMAGE kvpool-operator
# Build: docker build -t REGISTRY/kvpool:TAG . && docker push REGISTRY/kvpool:TAG

FROM python:3.11.7-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY operator ./operator
RUN python -m venv /opt/kvpool \
 && /opt/kvpool/bin/pip install --no-cache-dir .

FROM python:3.11.7-slim-bookworm
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kvpool \
 && install -d -o 10001 -g 10001 -m 0700 /var/lib/kvpool
COPY --from=build /opt/kvpool /opt/kvpool
ENV PATH=/opt/kvpool/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVPOOL_HOST=0.0.0.0 \
    KVPOOL_STATE_DIR=/var/lib/kvpool
USER 10001
EXPOSE 7400 7401
ENTRYPOINT []
CMD ["kvpool-agent"]
