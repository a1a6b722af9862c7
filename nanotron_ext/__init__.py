"""nanotron_ext: low-bandwidth and low-rank pre-training techniques on Hugging Face Nanotron 0.4."""
from nanotron_ext.patching import check_patches

check_patches()

__version__ = "0.1.0"
