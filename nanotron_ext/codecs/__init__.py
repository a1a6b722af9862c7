"""Pipeline-boundary codecs: what crosses the link between two pipeline stages."""
from nanotron_ext.codecs import identity  # noqa: F401  (registers "identity")
from nanotron_ext.codecs.base import CODECS, BoundaryCodec, get_codec, register_codec  # noqa: F401
