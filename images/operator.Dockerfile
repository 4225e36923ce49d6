# The DiffusionPipeline operator (kopf). Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/triptych-ai/triptych-operator:0.1.0 .
# It needs only kopf, the kubernetes client, PyYAML and pyzmq (it generates each pipeline's CURVE
# control-plane keys): the project is installed without its (GPU/model) dependencies, which the
# operator never imports.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/triptych
ENV PATH=/opt/triptych/bin:$PATH
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
RUN pip install -c constraints.txt kopf kubernetes PyYAML pyzmq
COPY triptych/ triptych/
COPY head/ head/
COPY worker/ worker/
COPY operator/ operator/
RUN pip install --no-deps .

FROM python:3.11-slim
COPY --from=build /opt/triptych /opt/triptych
ENV PATH=/opt/triptych/bin:$PATH PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["triptych-operator"]
