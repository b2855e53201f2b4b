"""A Triton kernel built for sm_90 on this machine, no GPU: its registers and its hot loops' instructions.

    python -m eval.bench.kernel_sass channels                      # the channel-score kernel at the step's shape
    python -m eval.bench.kernel_sass channels --knob BLOCK_N=16    # one of its launch knobs changed
    python -m eval.bench.kernel_sass combine --warps 4             # the rank interleave on 4 warps
    python -m eval.bench.kernel_sass channels --json out.json

The GPU is lent for minutes; the compiler runs anywhere. Registers (they bound occupancy) and the
instructions of each loop, by kind (multiply-adds against integer and logic, global loads, exchanges
through shared memory), answer most questions before a timing does: the Nsight Compute profile of
the channel kernel agreed with the register count built here. Build with the Triton the GPU runs,
since another version builds the same source differently (168 registers against 95, once): install
that version into a separate environment (`pip download triton==VERSION --no-deps`) and put its
site-packages first on PYTHONPATH. Shapes are one decode layer of the Llama-3-8B shape at B=16 x 32K.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import triton

ARCH = 90  # Hopper (H100, H200)
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")


def channels_kernel() -> tuple[Any, dict[str, str], dict[str, Any], int]:
    """The channel-score kernel (`ops.triton_channels`): 8 KV heads of 4 query heads, head_dim 128,
    share 3/8 (48 stored channels), 32-token blocks, its default launch knobs."""
    from sparseserve_hf.ops import channels, triton_channels

    signature = {"query_ptr": "*fp32", "abs_sum_ptr": "*fp32", "codes_ptr": "*u8", "words_ptr": "*i32",
                 "bounds_ptr": "*fp8e4nv", "ids_ptr": "*i64", "out_ptr": "*fp32", "stride_ib": "i32",
                 "stride_ih": "i32", "stride_ob": "i32", "stride_oh": "i32", "stride_mc": "i32", "stride_mw": "i32",
                 "code_mask": "i32", "one_bits": "i32", "num_blocks": "i32", "num_kv_heads": "i32"}  # fmt: skip
    size, dim, group = 32, 128, 4
    stored = channels.stored_channels(0.375, dim)
    constants = dict(D=dim, G=group, P=stored, S=size, BLOCK_G=group, BLOCK_N=triton_channels.BLOCK_N,
                     HEADER=channels.header_start(size, stored, dim), PER_BYTE=channels.PER_BYTE,
                     BITS=channels.BITS, CHUNK=4, UNROLL=triton_channels.UNROLL)  # fmt: skip
    return triton_channels._block_lse_kernel, signature, constants, triton_channels.NUM_WARPS


def combine_kernel() -> tuple[Any, dict[str, str], dict[str, Any], int]:
    """The hybrid score's rank interleave (`ops.triton_rank`) over 1,024-block tables, depth 64."""
    from sparseserve_hf.ops import triton_rank

    signature = {"first_ptr": "*fp32", "second_ptr": "*fp32", "out_ptr": "*fp32", "scratch_key_ptr": "*i32",
                 "scratch_idx_ptr": "*i32", "scratch_rank_ptr": "*i32", "num_table": "i32", "DEPTH": "i32"}  # fmt: skip
    return triton_rank._combine_kernel, signature, dict(BLOCK_N=1024, BLOCK_K=64), triton_rank.COMBINE_WARPS or 2


KERNELS: dict[str, Callable[[], tuple[Any, dict[str, str], dict[str, Any], int]]] = {
    "channels": channels_kernel,
    "combine": combine_kernel,
}


def build(fn: Any, signature: dict[str, str], constants: dict[str, Any], num_warps: int) -> bytes:
    """The cubin of `fn` for sm_90: `signature` types the runtime arguments, `constants` sets the
    constexpr ones."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    typed = dict(signature) | {name: "constexpr" for name in constants}
    fixed = {(fn.arg_names.index(name),): value for name, value in constants.items()}
    source = ASTSource(fn=fn, signature=typed, constexprs=fixed)
    compiled = triton.compile(source, target=GPUTarget("cuda", ARCH, 32), options={"num_warps": num_warps})
    return compiled.asm["cubin"]


def report(cubin: bytes) -> dict[str, Any]:
    """registers, instructions and their kinds (opcodes without modifiers), and each loop (a backward
    branch's body) with its own count and kinds."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = _run(tools / "cuobjdump", "--dump-resource-usage", str(path))
        sass = _run(tools / "nvdisasm", "-c", str(path))
    registers = re.search(r"REG:(\d+)", usage)
    if registers is None:
        raise RuntimeError(f"cuobjdump reported no register count:\n{usage}")
    lines = sass.splitlines()
    return {
        "registers": int(registers.group(1)),
        "instructions": sum(1 for line in lines if INSTRUCTION.match(line)),
        "kinds": dict(_kinds(lines).most_common()),
        "loops": _loops(lines),
    }


def _run(tool: Path, *args: str) -> str:
    return subprocess.run([str(tool), *args], capture_output=True, text=True, check=True).stdout


def _kinds(lines: list[str]) -> Counter:
    return Counter(m.group(2).split(".")[0] for line in lines if (m := INSTRUCTION.match(line)))


def _loops(lines: list[str]) -> list[dict[str, Any]]:
    """Each backward branch's body: the instructions from its target label to the branch."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line.strip()))}
    loops = []
    for i, line in enumerate(lines):
        target = BRANCH_TARGET.search(line) if INSTRUCTION.match(line) else None
        if target is None or labels.get(target.group(1), i) >= i:
            continue
        body = lines[labels[target.group(1)] : i + 1]
        kinds = _kinds(body)
        if sum(kinds.values()) > 1:  # not a bare self-branch (the end-of-kernel trap)
            loops.append({"instructions": sum(kinds.values()), "kinds": dict(kinds.most_common())})
    return loops


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=sorted(KERNELS))
    parser.add_argument("--knob", action="append", default=[], help="a constexpr argument NAME=VALUE (an integer)")
    parser.add_argument("--warps", type=int, default=None, help="default: the kernel's own launch")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    fn, signature, constants, warps = KERNELS[args.kernel]()
    for knob in args.knob:
        name, _, value = knob.partition("=")
        if name not in constants or not value.lstrip("-").isdigit():
            raise ValueError(f"--knob {knob!r}: give NAME=INTEGER for one of {sorted(constants)}")
        constants[name] = int(value)
    result = {"kernel": args.kernel, "triton": triton.__version__, "arch": f"sm_{ARCH}", "num_warps": args.warps or warps,
              "constants": constants} | report(build(fn, signature, constants, args.warps or warps))  # fmt: skip
    print(f"{args.kernel}: Triton {triton.__version__}, sm_{ARCH}, {result['num_warps']} warps, "
          f"{result['registers']} registers, {result['instructions']} instructions")  # fmt: skip
    for number, loop in enumerate(result["loops"]):
        top = ", ".join(f"{kind} {count}" for kind, count in list(loop["kinds"].items())[:10])
        print(f"  loop {number}: {loop['instructions']} instructions ({top})")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
