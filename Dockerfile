# One image for every pdserve role: `pdserve router|prefill|decode|up|bench ...` (compose.yaml).
#
#   docker build -t pdserve .                                     # CPU torch (the default)
#   docker build -t pdserve --build-arg TORCH_VARIANT=cu128 .     # CUDA 12.8 torch for GPUs
#
# TORCH_VARIANT names a wheel index under https://download.pytorch.org/whl/ (cpu, cu126, cu128,
# ...). Torch goes in first, from that index, so `pip install .` finds it satisfied and never
# pulls a different build.
#
# With no registry (deploy/offline_images.sh does this): PYTHON_IMAGE names a local base image
# with `python`, `pip`, gcc and libc6-dev, and WHEELHOUSE=1 installs every Python package from
# deploy/wheelhouse/ in the build context (pip --no-index), so the build touches no network.
# No `# syntax=` line: it would make BuildKit pull a frontend image.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG WHEELHOUSE=0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler at run time: on CPUs for the native decode-attention kernel (built on first use
# for the host's instruction set, kernels/cpu_attention.py), on GPUs for Triton's launchers.
# An offline base has it already.
RUN if ! command -v gcc >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# Only its README in a registry build (a few bytes, read only with WHEELHOUSE=1).
COPY deploy/wheelhouse /tmp/wheelhouse/
RUN if [ "$WHEELHOUSE" = 1 ]; then \
        PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheelhouse pip install "torch==${TORCH_VERSION}"; \
    else \
        pip install "torch==${TORCH_VERSION}" \
            --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"; \
    fi

# The other dependencies in a layer of their own: a change of the code reinstalls none of them.
COPY pyproject.toml /tmp/pyproject.toml
RUN if [ "$WHEELHOUSE" = 1 ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheelhouse; fi \
    && python -c "import tomllib; print(*tomllib.load(open('/tmp/pyproject.toml', 'rb')) \
        ['project']['dependencies'], sep='\n')" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt && rm /tmp/pyproject.toml /tmp/requirements.txt

WORKDIR /opt/pdserve
COPY pyproject.toml README.md pdserve_cli.py ./
COPY proto proto
COPY common common
COPY kernels kernels
COPY kv_store kv_store
COPY kv_transfer kv_transfer
COPY node_frontend node_frontend
COPY prefill_node prefill_node
COPY decode_node decode_node
COPY router router
COPY launcher launcher
COPY bench bench
COPY benchmarks benchmarks
# A CPU image never carries CUDA torch (a wheelhouse or a resolver could bring it).
RUN if [ "$WHEELHOUSE" = 1 ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheelhouse; fi \
    && pip install . && rm -rf /tmp/wheelhouse \
    && python -c "import pdserve_cli, common, router, launcher, bench, node_frontend, pdserve_proto" \
    && python -c "import sys, torch; assert sys.argv[1] != 'cpu' or torch.version.cuda is None, \
        'CUDA torch ' + torch.__version__ + ' in a CPU image'" "${TORCH_VARIANT}"

# The source tree is the import root, as in development (`python -m launcher.health_check` works).
ENV PYTHONPATH=/opt/pdserve:/opt/pdserve/proto \
    PDSERVE_CACHE_DIR=/cache
# /kv: where a shared-file KV store volume is mounted (a named volume takes this owner)
RUN useradd --create-home --uid 10001 pdserve && mkdir -p /cache /kv && chown pdserve /cache /kv
USER pdserve

EXPOSE 8000 50051 50061 50071
ENTRYPOINT ["pdserve"]
CMD ["--help"]
