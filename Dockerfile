# GPU image for real runs and Nsight Systems profiling.
#   docker build -t nanotron_ext .
#   docker run --gpus all --ipc=host -it nanotron_ext
# NVIDIA's PyTorch image brings CUDA, NCCL, a CUDA build of torch and Nsight Systems (nsys).
# Its torch must satisfy pyproject's `torch>=2.9` (torch.optim.Muon): images from 25.11 on do.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/nanotron_ext
COPY . .

# Install the package with everything pyproject.toml declares, pinning torch to the image's own
# build: if that build were too old pip fails here instead of pulling a multi-GB wheel.
RUN pip freeze | grep -i '^torch==' > /tmp/image-torch.txt \
 && pip install --no-cache-dir -c /tmp/image-torch.txt -e '.[dev]' \
 && python patches/apply.py

# Nsight Systems CLI, when the base image lacks it (NVIDIA's CUDA apt repository is configured there).
RUN command -v nsys >/dev/null || (apt-get update \
 && apt-get install -y --no-install-recommends nsight-systems-cli \
 && rm -rf /var/lib/apt/lists/*)

# nanotron's async TP linears assert this; it also keeps NCCL kernels in launch order.
ENV CUDA_DEVICE_MAX_CONNECTIONS=1
CMD ["bash"]
