# syntax=docker/dockerfile:1
# One image for every pdserve role: `pdserve router|prefill|decode|up|bench ...` (compose.yaml).
#
#   docker build -t pdserve .                                     # CPU torch (the default)
#   docker build -t pdserve --build-arg TORCH_VARIANT=cu128 .     # CUDA 12.8 torch for GPUs
#
# TORCH_VARIANT names a wheel index under https://download.pytorch.org/whl/ (cpu, cu126, cu128,
# ...). Torch goes in first, from that index, so `pip install .` finds it satisfied and never
# pulls a different build.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler at run time: on CPUs for the native decode-attention kernel (built on first use
# for the host's instruction set, kernels/cpu_attention.py), on GPUs for Triton's launchers.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"

WORKDIR /opt/pdserve
COPY pyproject.toml README.md pdserve_cli.py ./
COPY proto proto
COPY common common
COPY kernels kernels
COPY kv_store kv_store
COPY node_frontend node_frontend
COPY prefill_node prefill_node
COPY decode_node decode_node
COPY router router
COPY launcher launcher
COPY bench bench
COPY benchmarks benchmarks
RUN pip install . \
    && python -c "import pdserve_cli, common, router, launcher, bench, node_frontend, pdserve_proto"

# The source tree is the import root, as in development (`python -m launcher.health_check` works).
ENV PYTHONPATH=/opt/pdserve:/opt/pdserve/proto \
    PDSERVE_CACHE_DIR=/cache
RUN useradd --create-home --uid 10001 pdserve && mkdir -p /cache && chown pdserve /cache
USER pdserve

EXPOSE 8000 50051 50061 50071
ENTRYPOINT ["pdserve"]
CMD ["--help"]
