"""Speculative decoding: drafters (n-gram, standalone draft model), draft trees, verification and
acceptance (docs/architecture.md §5).

Import the pieces from their modules; this package file stays import-light. The speculative flags
are validated and defaulted with the rest of the configuration, in ``plait.config``.
"""
