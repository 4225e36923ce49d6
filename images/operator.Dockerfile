# The DiffusionPipeline operator (kopf) and triptych-metrics-api: the `operator` extra only (kopf, the
# kubernetes client, PyYAML, and pyzmq: it generates each pipeline's CURVE control-plane keys).
#   docker build -f images/operator.Dockerfile -t ghcr.io/triptych-ai/triptych-operator:0.1.0 .
#
# The build stage installs the dependencies in a layer of their own before it copies the code, so a change
# to the code reinstalls only the project (seconds); the image gets the finished venv, without pip.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS requirements
COPY pyproject.toml images/requirements.py /src/
RUN python /src/requirements.py /src/pyproject.toml operator >/requirements.txt

FROM ${BASE_IMAGE} AS build
# The index pip installs from: a build argument, which RUN sees, never an ENV kept in the image.
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/triptych/bin:$PATH
WORKDIR /src
COPY constraints.txt ./
COPY --from=requirements /requirements.txt ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m venv /opt/triptych && pip install -c constraints.txt -r requirements.txt
COPY pyproject.toml ./
COPY triptych/ triptych/
COPY head/ head/
COPY worker/ worker/
COPY operator/ operator/
RUN --mount=type=cache,target=/root/.cache/pip pip install --no-deps . && pip uninstall -qy pip setuptools

FROM ${BASE_IMAGE}
# A passwd entry for the user: kopf (getpass.getuser) and torch look the uid up and fail without one.
RUN groupadd --gid 10001 triptych \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin triptych
COPY --from=build /opt/triptych /opt/triptych
ENV PATH=/opt/triptych/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["triptych-operator"]
