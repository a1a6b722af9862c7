"""Pipeline-boundary codecs: what crosses the link between two pipeline stages."""
from nanotron_ext.codecs import identity, lossy  # noqa: F401  (register "identity", "topk", "int8", "int4", "lowrank")
from nanotron_ext.codecs.base import CODECS, BoundaryCodec, get_codec, register_codec  # noqa: F401
