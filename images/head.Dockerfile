# The GPU-less head (DiffusionServer + HTTP API): CPU-only PyTorch wheels, TCP Mooncake build.
#   docker build -f images/head.Dockerfile -t ghcr.io/triptych-ai/triptych-head:0.1.0 .
# The operator starts it as `triptych serve --disagg-role server ...`.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/triptych
ENV PATH=/opt/triptych/bin:$PATH
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
COPY triptych/ triptych/
COPY head/ head/
COPY worker/ worker/
COPY operator/ operator/
# The CPU index first so torch resolves to its small +cpu build (the constraint pins the version).
RUN pip install --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple \
      -c constraints.txt '.[cpu]'

FROM python:3.11-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 librdmacm1 libnuma1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/triptych /opt/triptych
ENV PATH=/opt/triptych/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
WORKDIR /var/lib/triptych
USER 10001:10001
EXPOSE 30000 5555-5560
ENTRYPOINT ["triptych"]
CMD ["serve", "--help"]
