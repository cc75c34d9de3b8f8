"""Speculative decoding: drafters (n-gram, standalone draft model), draft trees, verification and
acceptance (DESIGN 5).

Import the pieces from their modules; this package file stays import-light because
``plait.config`` reads ``plait.speculative.config`` while an EngineConfig is being built.
"""
