"""Parallel primitives: process groups, byte-accounted communication, pipeline links."""
