# GPU image for real runs and Nsight Systems profiling.
#   scripts/build_image.sh            (docker build when a daemon answers, else buildah without one)
#   docker build -t nanotron_ext .    (the same, by hand)
#   docker run --gpus all --ipc=host -it nanotron_ext
# NVIDIA's PyTorch image brings CUDA, NCCL, a CUDA build of torch and Nsight Systems (nsys).
# Its torch must satisfy pyproject's `torch>=2.9` (torch.optim.Muon): images from 25.11 on do (their pre-release
# 2.10.0a0+... sorts above 2.9; 25.09 and 25.10's 2.9.0a0+... below it). docs/profiling-and-benchmarks.md, "The
# Docker image", lists the bases.
# `scripts/build_image.sh --stand-in` builds it on a local Debian base with the CPU torch wheel instead (no GPU, no
# NVIDIA registry: what the build and `make test-quick` inside it are checked on).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/nanotron_ext
COPY . .

# Install the package with everything pyproject.toml declares, pinning torch to the image's own
# build: if that build were too old pip fails here instead of pulling a multi-GB wheel. The pin is read from
# the installed distribution (`pip freeze` may print `torch @ file:///...` for a locally built wheel).
# .venv: a view of the image's Python (system site-packages, and links to its commands: torchrun, ruff, ...) that
# the Makefile's targets and the tests use, so `make test` runs here against the image's torch with no set-up.
RUN python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > /tmp/image-torch.txt \
 && grep -i '^torch==' /tmp/image-torch.txt \
 && pip install --no-cache-dir -c /tmp/image-torch.txt -e '.[dev]' \
 && python patches/apply.py \
 && python -m venv --system-site-packages .venv \
 && scripts=$(dirname "$(command -v torchrun)") \
 && for f in "$scripts"/*; do [ -e ".venv/bin/${f##*/}" ] || ln -s "$f" .venv/bin/; done \
 && touch .venv/.installed

# Nsight Systems CLI, when the base image lacks it and has NVIDIA's CUDA apt repository (NVIDIA's images do).
# On a base without that repository (the stand-in) it says so in one line and goes on: the image has no nsys
# (docs/profiling-and-benchmarks.md says how to add it).
RUN if command -v nsys >/dev/null; then echo "nsys: $(command -v nsys)"; \
    elif apt-get update -qq >/dev/null 2>&1 && apt-cache show nsight-systems-cli >/dev/null 2>&1; then \
      apt-get install -y --no-install-recommends nsight-systems-cli && rm -rf /var/lib/apt/lists/*; \
    else rm -rf /var/lib/apt/lists/*; \
      echo "nsys: not in the base image and no apt repository offers nsight-systems-cli; no nsys in this image"; \
    fi

# nanotron's async TP linears assert this; it also keeps NCCL kernels in launch order.
ENV CUDA_DEVICE_MAX_CONNECTIONS=1
CMD ["bash"]
