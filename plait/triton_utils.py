"""Running Triton kernels on the CPU (TRITON_INTERPRET=1) for tests."""

from __future__ import annotations


def patch_interpreter_for_numpy() -> None:
    """triton 3.6's interpreter turns scalar tensors into Python ints with ``int(ndarray_of_shape_1)``,
    which NumPy >= 2.4 rejects (triton-lang/triton#9171), breaking every loop with a tensor bound.
    Re-register ``__index__`` with an explicit element read. Idempotent; harmless once fixed upstream."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_plait_numpy_fix", False):
        return

    def patched(tensor: type, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))  # type: ignore[attr-defined]

    patched._plait_numpy_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
