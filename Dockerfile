# syntax=docker/dockerfile:1
# The image helm/atomd runs: `atomd serve` (the engines) and `atomd-router`, CPU torch, the
# built-in default model and the C kernels prebuilt for every x86-64 target the engines
# dispatch to at run time (setup.py). From the repository root:
#
#   docker build -t atomd:0.1.0 .
#
# Two stages: `build` has a C compiler and makes a virtual environment (torch, the package
# with its kernels); the image copies that environment alone onto the bare base, so it has
# no compiler, no pip cache and no build tree. `make image-check` builds the same file from a
# local Debian base and a local package index (benchmarks/image.py, tests/test_image.py):
#
#   docker build --build-arg BASE_IMAGE=atomd-base:bookworm \
#     --build-arg TORCH_INDEX=http://127.0.0.1:PORT/simple/ \
#     --build-arg PIP_INDEX_URL=http://127.0.0.1:PORT/simple/ --network host .
#
# The install steps follow the Makefile's `venv` target (pip, then torch pinned, then the
# package); tests/test_dockerfile.py keeps the two in step.

# Any Debian bookworm image with `python` (3.11+) and its venv module.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
# Where torch comes from: the CPU build's index (PyPI's torch for Linux is the CUDA build).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# pip reads it from the environment: another index for everything else (unset: PyPI)
ARG PIP_INDEX_URL
# attention shapes to prebuild besides atomd/kernels/cbuild.py PREBUILT_ATTENTION's, e.g. "64x7,128x8"
ARG ATOMD_PREBUILD_ATTENTION=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/atomd
ENV PATH=/opt/atomd/bin:$PATH
RUN python -m pip install --upgrade pip
# torch first and pinned, the CPU build: an unpinned torch would pull a multi-GB CUDA build.
RUN python -m pip install --index-url ${TORCH_INDEX} torch==2.13.0
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY atomd ./atomd
COPY contracts ./contracts
COPY scheduler ./scheduler
COPY kv_transfer ./kv_transfer
COPY router ./router
COPY launch ./launch
# setup.py compiles the kernels into the wheel; fails without a compiler rather than ship none.
# pip also writes every module's bytecode: keep it, the root filesystem is read-only at run
# time, and without it each process compiles what it imports (torch's lazy imports inside the
# first requests: a float32 batch-1 run at 9 instead of 150 tokens/s).
RUN python -m pip install .

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/atomd/bin:$PATH
# the kernels' OpenMP runtime (no compiler here: nothing is ever built at run time)
# (apt-get clean: a base without Docker's apt hook keeps apt's ~80 MB package caches)
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && apt-get clean && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/atomd /opt/atomd

# Non-root; the chart runs it with runAsUser 10001 and a read-only root filesystem
# (writable: /tmp and $ATOMD_CACHE_DIR, both emptyDir volumes there; the engines copy the
# built-in model there at start, the kernels stay in the package).
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/atomd --shell /usr/sbin/nologin atomd
USER 10001:10001
WORKDIR /home/atomd
ENV ATOMD_CACHE_DIR=/home/atomd/.cache/atomd

EXPOSE 8000
ENTRYPOINT ["atomd"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
