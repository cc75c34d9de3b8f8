"""Triton attention: kernels (``plait.attention.triton.kernels``) and their torch references
(``plait.attention.triton.reference``). Nothing is imported here, so importing the package does not
require Triton."""
