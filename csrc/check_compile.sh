#!/usr/bin/env bash
# Compile every CUDA source under csrc/ with nvcc alone (no torch headers, nothing linked or run),
# so a syntax or template error in a kernel fails CI on a machine without a GPU.
#   csrc/check_compile.sh            # sm_90 (the H200)
#   NVCC_ARCH=sm_80 csrc/check_compile.sh
#   csrc/check_compile.sh --find-nvcc  # print the nvcc it would use; exit 1 when there is none
# nvcc is looked up as torch's cpp_extension does: $NVCC, $CUDA_HOME/bin, PATH, /usr/local/cuda/bin.
# Exits non-zero on the first source that fails, or when nvcc is missing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nvcc_bin="${NVCC:-}"
if [[ -z "$nvcc_bin" && -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]]; then
    nvcc_bin="$CUDA_HOME/bin/nvcc"
fi
if [[ -z "$nvcc_bin" ]]; then
    nvcc_bin="$(command -v nvcc || true)"
fi
if [[ -z "$nvcc_bin" && -x /usr/local/cuda/bin/nvcc ]]; then
    nvcc_bin=/usr/local/cuda/bin/nvcc
fi
if [[ -z "$nvcc_bin" ]]; then
    echo "check_compile: nvcc not found (set NVCC or CUDA_HOME, or put nvcc on PATH)" >&2
    exit 1
fi
if [[ "${1:-}" == "--find-nvcc" ]]; then
    echo "$nvcc_bin"
    exit 0
fi
arch="${NVCC_ARCH:-sm_90}"
out="$(mktemp -d /tmp/dflash_csrc_check.XXXXXX)"
trap 'rm -rf "$out"' EXIT
mapfile -t sources < <(find "$here" -name '*.cu' | sort)
if [[ ${#sources[@]} -eq 0 ]]; then
    echo "check_compile: no .cu sources under $here" >&2
    exit 1
fi
for src in "${sources[@]}"; do
    obj="$out/$(basename "${src%.cu}").o"
    echo "check_compile: $nvcc_bin -c -std=c++17 -O3 -arch=$arch -Werror all-warnings ${src#$here/}"
    "$nvcc_bin" -c -std=c++17 -O3 -arch="$arch" -Werror all-warnings -I"$here" "$src" -o "$obj"
done
echo "check_compile: ${#sources[@]} CUDA sources compile for $arch"
