"""What one training step of DeiT-T dispatches on the kernels (``scripts/launch_count.py``): non-view aten ops plus
Triton launches, against softmax's (SDPA) and the torch path's."""
import pytest
from helpers import load_script

pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from mhla.kernels import block  # noqa: E402

BOUND = 1.5  # the kernels' step may dispatch at most this many times what softmax's does


@pytest.mark.skipif(not isinstance(block._summaries_kernel, InterpretedFunction),
                    reason="counts the kernels' launches under Triton's interpreter (the CPU)")
def test_a_deit_t_mhla_step_on_the_kernels_dispatches_at_most_half_as_much_again_as_softmax():
    count = load_script("launch_count").dispatched
    softmax, no_launches = count("deit_tiny_softmax", "torch")
    assert no_launches == 0
    ops, launches = count("deit_tiny_mhla", "triton")
    assert launches == 12 * 5  # per block: norm statistics and forward; backward's two kernels and the norm's
    assert ops + launches <= BOUND * softmax, (ops, launches, softmax)
    torch_path, _ = count("deit_tiny_mhla", "torch")
    assert ops + launches < torch_path / 2, (ops + launches, torch_path)
