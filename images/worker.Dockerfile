# A role worker (encoder / denoiser / decoder, or the whole pipeline in monolithic mode): a CUDA
# runtime, the project's `head` and `worker` extras and Mooncake (the CUDA wheel, RDMA), with the
# verbs/RDMA-CM/NUMA libraries Mooncake loads.
#   docker build -f images/worker.Dockerfile -t ghcr.io/triptych-ai/triptych-worker:0.1.0 .
# The operator starts it as `triptych serve --disagg-role <role> ...`.
# Built without a GPU (scripts/images.sh): --build-arg BASE_IMAGE=<a Debian base with python3>
# --build-arg MOONCAKE_EXTRA=cpu (Mooncake's TCP-only wheel).
#
# Layers, largest and least often changed first: the system libraries, the user, the dependencies
# (torch and its CUDA libraries: nearly all of the image), then the project's own code (< 1 MB), so a
# change to the code rebuilds only the last layer (seconds) and a pull or an import fetches only it.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${BASE_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libibverbs1 librdmacm1 libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/*

# The requirements of the image's extras, read from pyproject.toml: the dependency layer below is
# rebuilt when they or constraints.txt change, not when another setting of pyproject.toml does.
FROM base AS requirements
ARG MOONCAKE_EXTRA=cuda
COPY pyproject.toml images/requirements.py /src/
RUN python3 /src/requirements.py /src/pyproject.toml head worker ${MOONCAKE_EXTRA} >/requirements.txt

# The bind shim (LD_PRELOAD, C) that keeps Mooncake's listeners on --disagg-p2p-hostname; the worker
# finds it through TRIPTYCH_BIND_SHIM and re-executes itself under it. The compiler stays in this stage.
FROM base AS shim
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY scripts/build-bind-shim.sh scripts/
COPY worker/triptych_worker/transfer/bind_shim.c worker/triptych_worker/transfer/
RUN bash scripts/build-bind-shim.sh /out/libtriptych_bind.so

FROM base
# A passwd entry for the user: kopf (getpass.getuser) and torch look the uid up and fail without one.
RUN groupadd --gid 10001 triptych \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin triptych
# The index pip installs from: a build argument, which RUN sees, never an ENV kept in the image.
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/triptych/bin:$PATH
WORKDIR /src
COPY constraints.txt ./
COPY --from=requirements /requirements.txt ./
# pip's cache is a build cache mount, never part of a layer.
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /opt/triptych && pip install -c constraints.txt -r requirements.txt
COPY pyproject.toml ./
COPY triptych/ triptych/
COPY head/ head/
COPY worker/ worker/
COPY operator/ operator/
# The project itself, without dependencies (they are all in the layer above).
RUN --mount=type=cache,target=/root/.cache/pip pip install --no-deps .
COPY --from=shim /out/libtriptych_bind.so /opt/triptych/lib/libtriptych_bind.so
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp HF_HOME=/cache/huggingface \
    TRIPTYCH_BIND_SHIM=/opt/triptych/lib/libtriptych_bind.so
WORKDIR /var/lib/triptych
USER 10001:10001
EXPOSE 19000
ENTRYPOINT ["triptych"]
CMD ["serve", "--help"]
