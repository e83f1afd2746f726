# flexdispatch with DeepEP (release v1.2.1) for Hopper GPUs (SM90), CUDA 12.
#   docker build -t flexdispatch:deepep .
#   docker run --gpus all --ipc=host --network=host --ulimit memlock=-1 \
#       --device=/dev/infiniband flexdispatch:deepep scripts/gpu_check.sh
# See docs/deepep.md for the multi-node environment (NCCL_*, NVSHMEM_*, IB devices).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.8.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG NVSHMEM_VERSION=3.3.20
ARG DEEPEP_REF=v1.2.1
ARG TORCH_CUDA_ARCH_LIST=9.0

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python, a compiler toolchain for DeepEP's extension, and the RDMA user-space libraries (the
# distribution's versions of the base image: pinning them would break on every base update).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-dev python3-pip git ninja-build \
        libibverbs-dev rdma-core ibverbs-providers infiniband-diags \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
    && python3 -m pip install "nvidia-nvshmem-cu12==${NVSHMEM_VERSION}" packaging==24.2 \
        wheel==0.45.1

# DeepEP from its pinned release tag, linked against the NVSHMEM wheel (which ships
# libnvshmem_host.so.3 without the unversioned name the build looks for).
WORKDIR /opt
RUN NVSHMEM_DIR=$(python3 -c 'import nvidia.nvshmem as m; print(m.__path__[0])') \
    && ln -sf "${NVSHMEM_DIR}/lib/libnvshmem_host.so.3" "${NVSHMEM_DIR}/lib/libnvshmem_host.so" \
    && git clone --depth 1 --branch "${DEEPEP_REF}" https://github.com/deepseek-ai/DeepEP.git \
    && NVSHMEM_DIR="${NVSHMEM_DIR}" python3 -m pip install --no-build-isolation ./DeepEP \
    && rm -rf DeepEP

WORKDIR /opt/flexdispatch
COPY . .
# hadolint ignore=DL3013
RUN python3 -m pip install ".[test,plot]"

# Build smoke check. There is no driver at build time, so deep_ep loads against the CUDA stub
# libcuda; selection must then say why it falls back (no CUDA), proving the guarded import runs.
RUN stubs=$(mktemp -d) \
    && ln -s /usr/local/cuda/lib64/stubs/libcuda.so "${stubs}/libcuda.so.1" \
    && LD_LIBRARY_PATH="${stubs}:${LD_LIBRARY_PATH:-}" python3 -c "\
import deep_ep, flexdispatch; \
from flexdispatch.dispatch.select import deepep_available; \
from flexdispatch.backends.deepep.support import deepep_support; \
print('deep_ep', deep_ep.__file__, 'flexdispatch', flexdispatch.__version__); \
print('deepep_available:', deepep_available()); \
print('auto selection here:', deepep_support(group=None, num_experts=256, ranks_per_node=8))" \
    && rm -rf "${stubs}"

CMD ["python3", "-m", "flexdispatch.cli", "--help"]
