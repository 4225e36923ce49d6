# A role worker (encoder / denoiser / decoder): CUDA runtime, the project with the `cuda` extra
# (Mooncake with RDMA), and the verbs/RDMA-CM/NUMA libraries Mooncake loads.
#   docker build -f images/worker.Dockerfile -t ghcr.io/triptych-ai/triptych-worker:0.1.0 .
# The operator starts it as `triptych serve --disagg-role <role> ...`.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS base
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libibverbs1 librdmacm1 libnuma1 \
    && rm -rf /var/lib/apt/lists/*

FROM base AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/triptych
ENV PATH=/opt/triptych/bin:$PATH
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
COPY triptych/ triptych/
COPY head/ head/
COPY worker/ worker/
COPY operator/ operator/
RUN pip install -c constraints.txt '.[cuda]'

FROM base
COPY --from=build /opt/triptych /opt/triptych
ENV PATH=/opt/triptych/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp HF_HOME=/cache/huggingface
WORKDIR /var/lib/triptych
USER 10001:10001
EXPOSE 19000
ENTRYPOINT ["triptych"]
CMD ["serve", "--help"]
