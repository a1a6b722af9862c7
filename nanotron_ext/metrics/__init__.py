"""Training metrics: FLOPs and MFU, memory, communication per group, JSONL/TensorBoard, NVTX, plots."""
