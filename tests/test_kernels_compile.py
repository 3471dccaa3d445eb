"""Every Triton kernel compiles for a Hopper GPU (sm_90) without one, in fp16 and with every option on.

The interpreter that the other kernel tests run on accepts what the compiler rejects (a ``tl.dot`` of an fp32 and
an fp16 operand, say): this compiles each kernel to sm_90 code in a process without ``TRITON_INTERPRET``.
"""
import os
import subprocess
import sys

import pytest
from helpers import ROOT

pytest.importorskip("triton.backends.nvidia")

COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mhla.kernels import block, features, short

SIZES = dict(H=2, C=64, D=32)
OPTIONS = {  # per module: its kernels, its constexprs beyond SIZES
    "block": ((block._summaries_kernel, block._output_kernel, block._query_backward_kernel,
               block._key_backward_kernel), dict(BLOCK_T=16, NORM=True)),
    "short": ((short._forward_kernel, short._grad_q_kernel, short._grad_kv_kernel),
              dict(NORM=True, GRAD_MIXING=True, MG_PAD=32, BLOCK_Q=64, BLOCK_K=64)),
    "features": ((features._rstd_kernel, features._norm_backward_kernel), dict(BLOCK_C=64, ROWS=16)),
}
TYPES = dict(qkv="*fp16", out="*fp16", grad_out="*fp16", block_ids="*i64", slots="*i32", N="i32", T="i32", H="i32",
             MG="i32", num_tokens="i32", feature_eps="fp32", eps="fp32")
kernels, constants = OPTIONS[sys.argv[1]]
for kernel in kernels:
    names = kernel.arg_names
    known = {**SIZES, **constants}
    constexprs = {names[i]: known[names[i]] for i in kernel.constexprs}
    signature = {name: "constexpr" if name in constexprs else TYPES.get(name, "*fp32") for name in names}
    triton.compile(ASTSource(kernel, signature, {(names.index(n),): v for n, v in constexprs.items()}),
                   target=GPUTarget("cuda", 90, 32))
"""


@pytest.mark.slow  # a fresh process, without the interpreter
@pytest.mark.parametrize("module", ["block", "short", "features"])
def test_the_kernels_compile_for_a_gpu_without_one(module):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    result = subprocess.run([sys.executable, "-c", COMPILE, module], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
