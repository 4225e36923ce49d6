# The DiffusionPipeline operator (kopf) and triptych-metrics-api: the `operator` extra only (kopf, the
# kubernetes client, PyYAML, and pyzmq: it generates each pipeline's CURVE control-plane keys).
#   docker build -f images/operator.Dockerfile -t ghcr.io/triptych-ai/triptych-operator:0.1.0 .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS build
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_INDEX_URL=${PIP_INDEX_URL}
RUN python -m venv /opt/triptych
ENV PATH=/opt/triptych/bin:$PATH
WORKDIR /src
COPY constraints.txt pyproject.toml ./
COPY triptych/ triptych/
COPY head/ head/
COPY worker/ worker/
COPY operator/ operator/
# pip's cache stays in this stage (scripts/images.sh mounts a persistent one); pip itself is removed
# from the venv the image runs (it installs nothing).
RUN pip install -c constraints.txt '.[operator]' \
    && pip uninstall -qy pip setuptools

FROM ${BASE_IMAGE}
COPY --from=build /opt/triptych /opt/triptych
ENV PATH=/opt/triptych/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
# A passwd entry for the user: kopf (getpass.getuser) and torch look the uid up and fail without one.
RUN groupadd --gid 10001 triptych \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin triptych
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["triptych-operator"]
