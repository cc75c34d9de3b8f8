"""Mixture-of-experts layers: routing (``router.py``), the reference expert loop (``reference.py``),
the fused Triton kernel (``fused_moe_triton.py``) and the layer that dispatches between them
(``layer.py``)."""
