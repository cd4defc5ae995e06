# Source this on the H200 device machine (offline; python3 has torch, triton, pluggy, pytest).
# Expects .gpu/ carried in: .gpu/whl (pydantic wheels + arnorm and arnorm-example wheels built here
# with `pip wheel --no-deps -w .gpu/whl . backends/arnorm-example`) and .gpu/flashinfer-bundle.tar.xz.
# The repo comes first on PYTHONPATH, so the code run is the working tree; the installed wheels only
# provide the dist-info (entry points) that plugin discovery reads.
set -e
mkdir -p /tmp/site /tmp/fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
if [ -f .gpu/flashinfer-bundle.tar.xz ] && [ ! -d /tmp/fi/flashinfer ]; then
  tar -xJf .gpu/flashinfer-bundle.tar.xz -C /tmp/fi
fi
export PYTHONPATH="$PWD:$PWD/backends/arnorm-example:/tmp/site:/tmp/fi${PYTHONPATH:+:$PYTHONPATH}"
export PATH="/tmp/site/bin:$PATH"
export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 FLASHINFER_USE_CUDA_NORM=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
set +e
