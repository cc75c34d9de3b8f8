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


def patch_interpreter_fp8_casts() -> None:
    """triton 3.6's interpreter narrows floats to fp8 by truncating the mantissa, and a mantissa that
    rounds up past its top bit wraps to the lower binade (7.95 becomes 4.0 in e4m3), where the GPU
    rounds to nearest even. Casts to ``float8e4nv`` / ``float8e5`` go through torch's conversion
    instead (round to nearest even, as the hardware does for in-range values). Idempotent."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp
    if getattr(original, "_plait_fp8_fix", False):
        return
    torch_fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        dst = dst_type.scalar
        if dst in torch_fp8:
            src_ty = src.dtype.scalar
            data = src.data
            if src_ty == tl.bfloat16:  # stored as uint16: widen to float32 bits
                data = (data.astype(np.uint32) << 16).view(np.float32)
            wide = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            out = wide.to(torch_fp8[dst]).view(torch.uint8).numpy()
            return interpreter.TensorHandle(out, dst)
        return original(self, src, dst_type, rounding_mode)

    create_fp_to_fp._plait_fp8_fix = True  # type: ignore[attr-defined]
    builder.create_fp_to_fp = create_fp_to_fp


def patch_interpreter_nested_calls() -> None:
    """triton 3.6's interpreter re-patches ``triton.language`` (``inspect.getmembers`` over ``tl``,
    ``tl.tensor``, ``tl.math`` and ``tl.core``, a few milliseconds) on every call of a ``@triton.jit``
    helper from inside a kernel, once per program instance: a fifth of an interpreted engine run. The
    launch already patched those modules with the same builder and restores them when its grid is done,
    so a nested call whose modules are all patched skips the repeat (one it adds is patched as before).
    Outputs are unchanged: the patched members are the same functions either way. Idempotent."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    if getattr(original, "_plait_nested_fix", False):
        return
    patched_langs: list[set[int]] = []  # ids of the modules the launch in progress patched (0 or 1 entry)

    def langs_of(fn: object) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}  # type: ignore[attr-defined]

    def patch_lang(fn: object):  # type: ignore[no-untyped-def]
        langs = langs_of(fn)
        if patched_langs and langs <= patched_langs[0]:  # a helper called from the running kernel
            return interpreter._LangPatchScope()  # nothing set, nothing to restore
        scope = original(fn)
        if patched_langs:  # a helper that sees a module the kernel did not: patched until the launch ends
            patched_langs[0] |= langs
            return scope
        patched_langs.append(langs)  # the launch itself (GridExecutor), which restores in a finally
        restore = scope.restore

        def restore_and_forget() -> None:
            patched_langs.clear()
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_lang._plait_nested_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
