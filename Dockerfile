# warmstart: operator, node agent and worker launcher in one image.
# Debian 13's python3 (3.13) in a virtual environment, and CRIU 4.2 built with hack/criu-patches, as a folder
# of its own.
# Build with BuildKit (docker build, docker buildx, buildctl); `hack/control-plane images` builds it here without
# a registry.

# CRIU as a folder of its own (program, loader, libraries): the agent runs it inside a worker container's
# namespaces through a descriptor of this folder, where none of the image's paths exist. CRIU (the release in
# hack/criu-version) built from Debian's source tarball (checksum pinned) with hack/criu-patches (the restorer
# fills memory with several readers), as hack/criu-setup builds it; 4.2 because 4.1 cannot dump a listening
# TCP socket on kernels 6.16 and later (vLLM keeps some).
FROM debian:trixie-slim AS criu
# The release, its checksum, the build's dependencies and name: one file, which hack/criu-setup reads too.
COPY hack/criu-version /tmp/criu-version
COPY hack/criu-patches /tmp/criu-patches
RUN . /tmp/criu-version \
 && apt-get update \
 && apt-get install -y --no-install-recommends $(echo "$CRIU_BUILD_DEPENDS" | tr , ' ') \
      curl ca-certificates xz-utils patch \
 && curl -fsSL -o /tmp/criu.tar.xz "http://deb.debian.org/debian/pool/main/c/criu/criu_${CRIU_VERSION}.orig.tar.xz" \
 && echo "${CRIU_SHA256}  /tmp/criu.tar.xz" | sha256sum -c - \
 && mkdir /tmp/criu && tar -xJf /tmp/criu.tar.xz -C /tmp/criu --strip-components=1 \
 && for patch in /tmp/criu-patches/*.patch; do patch -d /tmp/criu -p1 < "$patch"; done \
 && make -C /tmp/criu -j"$(nproc)" GITID="$CRIU_GITID" criu \
 && mkdir /opt/criu \
 && cp /tmp/criu/criu/criu /opt/criu/ \
 && ldd /opt/criu/criu | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | xargs -r cp -L -t /opt/criu/ \
 && cp -L /lib64/ld-linux-x86-64.so.2 /opt/criu/ \
 && /opt/criu/ld-linux-x86-64.so.2 --library-path /opt/criu /opt/criu/criu --version

FROM debian:trixie-slim

# APT_PACKAGES and VENV_OPTIONS make the CPU worker image from the same recipe: the builtin engine on Debian's
# PyTorch (CPU only, a few hundred MB; PyPI's Linux build is the CUDA one, several GB):
#   docker build --build-arg EXTRAS=engine --build-arg APT_PACKAGES="python3-torch python3-numpy" \
#     --build-arg VENV_OPTIONS=--system-site-packages -t ghcr.io/warmstart/warmstart-worker:0.1.0-cpu .
ARG APT_PACKAGES=""
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv iproute2 util-linux ca-certificates \
      ${APT_PACKAGES} \
 && rm -rf /var/lib/apt/lists/*
COPY --from=criu /opt/criu /opt/criu
RUN printf '#!/bin/sh\nexec /opt/criu/ld-linux-x86-64.so.2 --library-path /opt/criu /opt/criu/criu "$@"\n' \
      > /usr/local/bin/criu \
 && chmod 755 /usr/local/bin/criu && criu --version

ARG VENV_OPTIONS=""
RUN python3 -m venv ${VENV_OPTIONS} /opt/warmstart
ENV PATH=/opt/warmstart/bin:$PATH

WORKDIR /src
# The control-plane image (operator, agent) needs the CUDA checkpoint bindings only; the GPU worker image adds
# the engines and what Triton compiles its launcher with:
#   docker build --build-arg EXTRAS=gpu,engine,vllm --build-arg APT_PACKAGES="gcc libc6-dev python3-dev" \
#     -t ghcr.io/warmstart/warmstart-worker:0.1.0 .
ARG EXTRAS=gpu
# Dependencies first, from pyproject.toml alone, so a change to the code does not download them again. A build
# behind a TLS-intercepting proxy can hand its CA bundle in as the optional secret `extra-ca` (not kept in
# the image): --secret id=extra-ca,src=/etc/ssl/certs/ca-certificates.crt
COPY pyproject.toml ./
RUN --mount=type=secret,id=extra-ca,required=false \
    if [ -s /run/secrets/extra-ca ]; then export PIP_CERT=/run/secrets/extra-ca; fi \
 && mkdir warmstart && touch warmstart/__init__.py README.md \
 && pip install --no-cache-dir ".[${EXTRAS}]" \
 && pip uninstall -y warmstart && rm -rf warmstart README.md build warmstart.egg-info
COPY README.md ./
COPY warmstart ./warmstart
RUN --mount=type=secret,id=extra-ca,required=false \
    if [ -s /run/secrets/extra-ca ]; then export PIP_CERT=/run/secrets/extra-ca; fi \
 && pip install --no-cache-dir --no-deps . && rm -rf /src

# The operator runs as this user; the agent's DaemonSet runs privileged as root.
RUN useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin warmstart
WORKDIR /
ENTRYPOINT ["warmstart"]
CMD ["--help"]
