# kvtierd's container image: the daemon as entrypoint, as a non-root user (docs/deployment.md).
#   docker build -t kvtierd:0.1.0 .
# BASE_IMAGE: any Debian bookworm image with apt; scripts/docker-check makes one from Debian's
# packages (debootstrap + docker import) where no image registry is reachable.
# PIP_EXTRA_INDEX_URL: where pip finds the torch build to use (e.g. a CPU-only index); unset,
# pip takes torch from the default index. A wheelhouse/ folder in the build context is a local
# source of wheels; OFFLINE=1 then installs from it alone (scripts/docker-check).
ARG BASE_IMAGE=debian:bookworm-slim

# Stage 1: the wheel, and a virtualenv with it and its dependencies in /opt/kvtierd.
FROM ${BASE_IMAGE} AS build
ARG PIP_EXTRA_INDEX_URL=""
ARG OFFLINE=""
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# (pyproject.toml makes the COPY valid when there is no wheelhouse)
COPY pyproject.toml wheelhouse* /wheelhouse/
COPY pyproject.toml README.md ./
COPY kvtierd ./kvtierd
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip install ${OFFLINE:+--no-index} --find-links /wheelhouse build hatchling \
    && /opt/build/bin/python -m build --wheel --no-isolation --outdir /dist . \
    && python3 -m venv /opt/kvtierd \
    && /opt/kvtierd/bin/pip install ${OFFLINE:+--no-index} --find-links /wheelhouse /dist/kvtierd-*.whl

# Stage 2: Python and that virtualenv, nothing else.
FROM ${BASE_IMAGE} AS runtime
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/kvtierd \
       --shell /usr/sbin/nologin kvtierd \
    && install -d -o kvtierd -g kvtierd -m 0700 /run/kvtierd /var/lib/kvtierd
COPY --from=build /opt/kvtierd /opt/kvtierd
COPY deploy/docker/kvtierd.yaml /etc/kvtierd/kvtierd.yaml
ENV PATH=/opt/kvtierd/bin:$PATH PYTHONUNBUFFERED=1
USER kvtierd
# The socket (with the arena, which co-located clients map) and the SSD tier.
VOLUME ["/run/kvtierd", "/var/lib/kvtierd"]
# health_address (grpc.health.v1 only) and /metrics
EXPOSE 8081 9400
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "kvtierd.server.health_probe", "127.0.0.1:8081"]
ENTRYPOINT ["kvtierd"]
CMD ["serve", "--config", "/etc/kvtierd/kvtierd.yaml"]
