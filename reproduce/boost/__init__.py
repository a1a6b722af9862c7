"""BOOST reproduction scripts (see reproduce/boost/README.md)."""
