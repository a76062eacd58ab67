# syntax=docker/dockerfile:1
# The image helm/atomd runs: `atomd serve` (the engines) and `atomd-router`, CPU torch and
# the built-in default model. From the repository root:
#
#   docker build -t atomd:0.1.0 .
#
# The install steps follow the Makefile's `venv` target (pip, then torch pinned, then the
# package); tests/test_dockerfile.py keeps the two in step.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler and OpenMP: the attention kernels are built at first use for the node's CPU
# (-march=native), so they cannot be built here. Without them the engines fall back to SDPA.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
 && rm -rf /var/lib/apt/lists/*

RUN python -m pip install --upgrade pip
# torch first and pinned, the CPU build: an unpinned torch would pull a multi-GB CUDA build.
RUN python -m pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /src
COPY pyproject.toml README.md ./
COPY atomd ./atomd
COPY scheduler ./scheduler
COPY kv_transfer ./kv_transfer
COPY router ./router
COPY launch ./launch
RUN python -m pip install . && rm -rf /src

# Non-root; the chart runs it with runAsUser 10001 and a read-only root filesystem
# (writable: /tmp and $ATOMD_CACHE_DIR, both emptyDir volumes there).
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/atomd --shell /usr/sbin/nologin atomd
USER 10001:10001
WORKDIR /home/atomd
ENV ATOMD_CACHE_DIR=/home/atomd/.cache/atomd
# The built-in model ships in the package; fail the build if it does not load from there.
RUN python -c "from atomd.model.default import default_model_dir; print(default_model_dir())"

EXPOSE 8000
ENTRYPOINT ["atomd"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
