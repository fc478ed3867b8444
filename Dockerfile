# warmstart: operator, node agent and worker launcher in one image.
# CRIU >= 4 is needed (Debian 12's 3.17 fails on 6.x kernels): Debian 13 ships 4.1.
FROM python:3.12-slim-trixie

RUN apt-get update \
 && apt-get install -y --no-install-recommends criu iproute2 util-linux \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY warmstart ./warmstart
# Engines (torch, vLLM) come from the worker image built on top of this one; see README.
RUN pip install --no-cache-dir . && rm -rf /src

# The operator runs as this user; the agent's DaemonSet runs privileged as root.
RUN useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin warmstart
WORKDIR /
ENTRYPOINT ["warmstart"]
CMD ["--help"]
