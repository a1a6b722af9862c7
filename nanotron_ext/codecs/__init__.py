"""Pipeline-boundary codecs: what crosses the link between two pipeline stages (the interface in base.py;
the core's identity codec and lossy baselines, built by nanotron_ext.models.pieces.CorePieces)."""
from nanotron_ext.codecs.base import BoundaryCodec, BoundaryDecoder, BoundaryEncoder  # noqa: F401
