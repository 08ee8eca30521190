# The zloader image for the broker and the workers (deploy/k8s, docs/deploy.md).
#
#   docker build -t REGISTRY/zloader:0.1.0 .
#
# Workers run your pipelines' code: every package that code imports must be installed
# here (pass them in EXTRA_PACKAGES, or build FROM this image). Your own modules that are
# not installed travel with the pipeline. The protocol also requires every peer (broker,
# workers, trainers) to run the same Python minor version and the same cloudpickle
# version: match PYTHON_VERSION to your trainers' Python and pin cloudpickle to theirs,
# e.g. --build-arg EXTRA_PACKAGES="cloudpickle==3.1.1 pillow==11.0.0".
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG EXTRA_PACKAGES=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what the package build reads: setup.cfg names README.md as the long description.
WORKDIR /src
COPY pyproject.toml setup.cfg setup.py README.md ./
COPY zloader ./zloader
# Broker and workers need only install_requires (numpy, pyzmq, psutil, cloudpickle,
# prometheus-client), all of them wheels, no torch. A C compiler builds the compiled core
# (docs/native.md) and leaves with the sources, in the same layer.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install . ${EXTRA_PACKAGES} \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* \
    && cd / && rm -rf /src

# A fixed numeric uid, so that runAsNonRoot can check it; the manifests run as 10001.
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/zloader \
        --shell /usr/sbin/nologin zloader
USER 10001
WORKDIR /home/zloader

# 5555: the broker's control port (--bind). 9100: its metrics (--metrics-port). Workers
# listen on a data port the kernel picks at start-up, so it cannot be listed here.
EXPOSE 5555 9100

# No service starts by default: the manifests give `command:` (zloader-broker or
# zloader-worker) and their arguments.
CMD ["zloader-broker", "--help"]
