"""p2p_rows_kernels.launch_shape: how a decode round's rows split over the kernels' programs (the flags
pair program b of every rank, so the split must cover each element once and fit the flag slots)."""

import pytest

from plait.distributed import p2p_rows_kernels as kernels


@pytest.mark.parametrize("numel", [0, 1, 4095, 4096, 4097, 128 * 4096, 256 * 4096, 8192 * 4096, 3 * 4608])
def test_launch_shape_covers_every_element_once_within_the_flag_slots(numel: int) -> None:
    programs, span = kernels.launch_shape(numel)
    assert 1 <= programs <= kernels.MAX_PROGRAMS
    assert span % kernels.BLOCK == 0 and span > 0
    assert programs * span >= numel  # every element has a program
    assert (programs - 1) * span < max(numel, 1)  # and no program is left without elements


def test_a_128_row_decode_bucket_of_llama_8b_splits_over_64_programs_of_two_blocks():
    assert kernels.launch_shape(128 * 4096) == (64, 2 * kernels.BLOCK)
