# The GPU-less head (DiffusionServer + HTTP API): the `head` extra only, no torch, no Mooncake.
#   docker build -f images/head.Dockerfile -t ghcr.io/triptych-ai/triptych-head:0.1.0 .
# The operator starts it as `triptych serve --disagg-role server ...`. Request validation reads the
# model's JSON configs (the worker package's adapters, imported without torch), so the project's
# pure-Python packages are all installed, their heavy dependencies are not.
#
# The build stage installs the dependencies in a layer of their own before it copies the code, so a change
# to the code reinstalls only the project (seconds); the image gets the finished venv, without pip, and
# without the libraries' own test suites (numpy's and pycryptodome's: ~25 MB nothing imports).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS requirements
COPY pyproject.toml images/requirements.py /src/
RUN python /src/requirements.py /src/pyproject.toml head >/requirements.txt

FROM ${BASE_IMAGE} AS build
# The index pip installs from: a build argument, which RUN sees, never an ENV kept in the image.
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/triptych/bin:$PATH
WORKDIR /src
COPY constraints.txt ./
COPY --from=requirements /requirements.txt ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m venv /opt/triptych && pip install -c constraints.txt -r requirements.txt
# The image gets /opt/triptych alone (COPY --from=build below), so files removed here never reach it.
RUN find /opt/triptych/lib/python3.11/site-packages -type d \
    \( -path '*/numpy/tests' -o -path '*/numpy/*/tests' -o -path '*/Crypto/SelfTest' \) -prune -exec rm -rf {} +
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
WORKDIR /var/lib/triptych
# The default --output-path (outputs, relative): writable by the head's user, so a head run without a
# results volume starts (the result store checks at start-up that it can write there).
RUN mkdir -p /var/lib/triptych/outputs && chown 10001:10001 /var/lib/triptych/outputs
USER 10001:10001
EXPOSE 30000 5555-5560
ENTRYPOINT ["triptych"]
CMD ["serve", "--help"]
