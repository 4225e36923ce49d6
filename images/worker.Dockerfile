# A role worker (encoder / denoiser / decoder, or the whole pipeline in monolithic mode): a CUDA
# runtime, the project's `head` and `worker` extras and Mooncake (the CUDA wheel, RDMA), with the
# verbs/RDMA-CM/NUMA libraries Mooncake loads.
#   docker build -f images/worker.Dockerfile -t ghcr.io/triptych-ai/triptych-worker:0.1.0 .
# The operator starts it as `triptych serve --disagg-role <role> ...`.
# Built without a GPU (scripts/images.sh): --build-arg BASE_IMAGE=<a Debian base with python3>
# --build-arg MOONCAKE_EXTRA=cpu (Mooncake's TCP-only wheel).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${BASE_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libibverbs1 librdmacm1 libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/*

FROM base AS build
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG MOONCAKE_EXTRA=cuda
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_INDEX_URL=${PIP_INDEX_URL}
RUN python3 -m venv /opt/triptych
ENV PATH=/opt/triptych/bin:$PATH
WORKDIR /src
COPY constraints.txt pyproject.toml ./
COPY triptych/ triptych/
COPY head/ head/
COPY worker/ worker/
COPY operator/ operator/
# pip's cache stays in this stage (scripts/images.sh mounts a persistent one); pip itself is removed
# from the venv the image runs (it installs nothing).
RUN pip install -c constraints.txt ".[head,worker,${MOONCAKE_EXTRA}]" \
    && pip uninstall -qy pip setuptools
# The bind shim (LD_PRELOAD, C) that keeps Mooncake's listeners on --disagg-p2p-hostname; the worker
# finds it through TRIPTYCH_BIND_SHIM and re-executes itself under it. The compiler stays in this stage.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY scripts/build-bind-shim.sh scripts/
RUN bash scripts/build-bind-shim.sh /opt/triptych/lib/libtriptych_bind.so

FROM base
COPY --from=build /opt/triptych /opt/triptych
ENV PATH=/opt/triptych/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp HF_HOME=/cache/huggingface \
    TRIPTYCH_BIND_SHIM=/opt/triptych/lib/libtriptych_bind.so
WORKDIR /var/lib/triptych
# A passwd entry for the user: kopf (getpass.getuser) and torch look the uid up and fail without one.
RUN groupadd --gid 10001 triptych \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin triptych
USER 10001:10001
EXPOSE 19000
ENTRYPOINT ["triptych"]
CMD ["serve", "--help"]
