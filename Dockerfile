# warmstart: operator, node agent and worker launcher in one image.
# CRIU >= 4 is needed (Debian 12's 3.17 fails on 6.x kernels): Debian 13 ships 4.1.
FROM python:3.12-slim-trixie

RUN apt-get update \
 && apt-get install -y --no-install-recommends criu iproute2 util-linux \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY warmstart ./warmstart
# The control-plane image (operator, agent) needs the CUDA checkpoint bindings only; the worker image adds the
# engines: docker build --build-arg EXTRAS=gpu,engine,vllm -t warmstart-worker .
ARG EXTRAS=gpu
RUN pip install --no-cache-dir ".[${EXTRAS}]" && rm -rf /src

# The operator runs as this user; the agent's DaemonSet runs privileged as root.
RUN useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin warmstart
WORKDIR /
ENTRYPOINT ["warmstart"]
CMD ["--help"]
