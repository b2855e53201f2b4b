"""A Triton kernel built for sm_90 (or --arch) on this machine, no GPU: its registers, shared memory and hot loops' instructions.

    python -m eval.bench.kernel_sass channels                      # the channel-score kernel at the step's shape
    python -m eval.bench.kernel_sass channels --knob BLOCK_N=16    # one of its launch knobs changed
    python -m eval.bench.kernel_sass channels_mma                  # the same scores on tensor cores
    python -m eval.bench.kernel_sass combine --warps 4             # the rank interleave on 4 warps
    python -m eval.bench.kernel_sass union --knob BLOCK_N=4096     # the top-k and union over 4,096-block tables
    python -m eval.bench.kernel_sass decode --stages 2             # the attention split kernel, 2 stages
    python -m eval.bench.kernel_sass decode --knob LATE=1          # its late half (slots through the table)
    python -m eval.bench.kernel_sass append                        # the lookup's listing of its misses
    python -m eval.bench.kernel_sass channels --json out.json
    python -m eval.bench.kernel_sass channels --arch 80 --knob NATIVE_FP8=0   # for an A100: 8-bit floats from bits

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import triton

ARCH = 90  # Hopper (H100, H200): what --arch defaults to
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")


@dataclass(frozen=True)
class Kernel:
    """A kernel as the step launches it: `signature` types the runtime arguments, `constants` sets the
    constexpr ones; `aligned_ints` are the integer arguments that are multiples of 16 at the step's
    shape (a launch specializes on them, as on every 16-byte aligned pointer, and can then vectorize
    the addresses built from them); `num_stages` None where the launch passes none."""

    fn: Any
    signature: dict[str, str]
    constants: dict[str, Any]
    num_warps: int
    num_stages: int | None = None
    aligned_ints: tuple[str, ...] = ()
    max_registers: int | None = None  # the launch's `maxnreg`, where it passes one


def channels_kernel() -> Kernel:
    """The channel-score kernel (`ops.triton_channels`): 8 KV heads of 4 query heads, head_dim 128,
    share 3/8 (48 stored channels), 32-token blocks, its default launch knobs."""
    from sparseserve_hf.ops import channels, triton_channels

    signature = {"query_ptr": "*fp32", "abs_sum_ptr": "*fp32", "codes_ptr": "*u8", "words_ptr": "*i32",
                 "ids_ptr": "*i64", "out_ptr": "*fp32", "stride_ib": "i32",
                 "stride_ih": "i32", "stride_ob": "i32", "stride_oh": "i32", "stride_mc": "i32", "stride_mw": "i32",
                 "code_mask": "i32", "one_bits": "i32", "num_blocks": "i32", "num_kv_heads": "i32"}  # fmt: skip
    size, dim, group = 32, 128, 4
    stored = channels.stored_channels(0.375, dim)
    constants = dict(
        D=dim,
        G=group,
        P=stored,
        S=size,
        BLOCK_G=group,
        BLOCK_N=triton_channels.BLOCK_N,
        HEADER=channels.header_start(size, stored, dim),
        PER_BYTE=channels.PER_BYTE,
        BITS=channels.BITS,
        CHUNK=4,
        UNROLL=triton_channels.UNROLL,
        PREFETCH=triton_channels.PREFETCH,
        HOIST_Q=triton_channels.HOIST_Q,
        Q_AHEAD=triton_channels.Q_AHEAD,
        STAGES=triton_channels.STAGES,
        NATIVE_FP8=int(triton_channels.NATIVE_FP8 is not False),
    )  # fmt: skip (0 for --arch 80)
    return Kernel(triton_channels._block_lse_kernel, signature, constants, triton_channels.NUM_WARPS)


def channels_mma_kernel() -> Kernel:
    """The channel scores on tensor cores (`ops.triton_channels_mma`, `triton_channels.MMA`): the same
    shape as `channels_kernel`, one warp per program, 16 blocks in turn (its loop is one block)."""
    from sparseserve_hf.ops import channels, triton_channels_mma

    signature = {"query_ptr": "*fp32", "abs_sum_ptr": "*fp32", "words_ptr": "*i32", "ids_ptr": "*i64",
                 "out_ptr": "*fp32", "stride_ib": "i32", "stride_ih": "i32", "stride_ob": "i32", "stride_oh": "i32",
                 "stride_mw": "i32", "code_mask": "i32", "num_blocks": "i32", "num_kv_heads": "i32"}  # fmt: skip
    size, dim, group = 32, 128, 4
    stored = channels.stored_channels(0.375, dim)
    constants = dict(D=dim, G=group, P=stored, HEADER=channels.header_start(size, stored, dim),
                     BLOCKS=triton_channels_mma.BLOCKS)  # fmt: skip
    aligned = ("stride_ib", "stride_ih", "stride_ob", "stride_oh", "stride_mw")
    return Kernel(triton_channels_mma._block_lse_mma_kernel, signature, constants, 1, aligned_ints=aligned,
                  max_registers=triton_channels_mma.MAX_REGISTERS)  # fmt: skip


def combine_kernel() -> Kernel:
    """The hybrid score's rank interleave (`ops.triton_rank`) over 1,024-block tables, depth 64."""
    from sparseserve_hf.ops import triton_rank

    signature = {"first_ptr": "*fp32", "second_ptr": "*fp32", "out_ptr": "*fp32", "scratch_key_ptr": "*i32",
                 "scratch_idx_ptr": "*i32", "scratch_rank_ptr": "*i32", "num_table": "i32", "DEPTH": "i32"}  # fmt: skip
    constants = dict(BLOCK_N=1024, BLOCK_K=64)
    warps = triton_rank.COMBINE_WARPS or 2
    return Kernel(triton_rank._combine_kernel, signature, constants, warps, aligned_ints=("num_table", "DEPTH"))


def union_kernel() -> Kernel:
    """The default selection's per-head top-k and GQA union (`ops.triton_select`) over the rank
    interleave's integer scores: 1,024-block tables, K = 63, sink and window 1, 4 query heads per KV head."""
    from sparseserve_hf.ops import triton_select

    signature = {"scores_ptr": "*fp32", "num_blocks_ptr": "*i64", "union_ptr": "*i64", "valid_ptr": "*i8",
                 "stride_sb": "i32", "stride_sh": "i32", "num_table": "i32", "num_kv_heads": "i32",
                 "score_floor": "fp32"}  # fmt: skip
    selected, group = 63, 4
    integer_keys, bits = triton_select.key_bits(-2 * selected)  # the interleave's floor at depth K
    constants = dict(K=selected, SINK=1, WINDOW=1, G=group, BLOCK_G=group, BLOCK_N=1024, U=group * selected,
                     BLOCK_U=256, STEPS=0, INTEGER_KEYS=integer_keys, BITS=bits)  # fmt: skip
    warps = triton_select.UNION_WARPS or 4
    return Kernel(triton_select._select_union_kernel, signature, constants, warps,
                  aligned_ints=("stride_sb", "stride_sh", "num_table"))  # fmt: skip


def decode_kernel() -> Kernel:
    """The sparse decode attention's split kernel (`ops.triton_decode`), as the step launches its resident
    half: 4 query heads per KV head, head_dim 128, bf16 32-token blocks, a 256-entry selection (G x 63
    blocks, padded), no head mask, no 8-bit blocks, no per-block log-sum-exps (`--knob BLOCK_LSE=1`)."""
    from sparseserve_hf.ops import triton_decode

    signature = {"q_ptr": "*bf16", "pool_ptr": "*bf16", "slots_ptr": "*i64", "mask_ptr": "*i64",
                 "scales_ptr": "*bf16", "tail_k_ptr": "*bf16", "tail_v_ptr": "*bf16", "tail_len_ptr": "*i64",
                 "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "resident_ptr": "*i64",
                 "late_entries_ptr": "*i32", "block_slot_ptr": "*i64", "lse_ptr": "*fp32"}  # fmt: skip
    strides = ("stride_qb", "stride_qh", "stride_sb", "stride_sh", "stride_mb", "stride_mh", "stride_tb", "stride_th",
               "stride_ts", "stride_lb", "stride_lh")  # fmt: skip
    counts = ("num_kv_heads", "num_loaded", "num_splits", "first_part", "num_parts")
    signature |= {name: "i32" for name in strides + counts} | {"scaling": "fp32"}
    size, dim, group = 32, 128, 4
    constants = dict(G=group, BLOCK_G=16, S=size, D=dim, BLOCK_D=dim, BLOCK_U=triton_decode.TILE_TOKENS // size,
                     BLOCK_LOADED=256, TAIL_TOKENS=size, HAS_MASK=False, IEEE=False,
                     MIN_PER_SPLIT=triton_decode.MIN_BLOCKS_PER_SPLIT, SCALED=False, LATE=False,
                     BLOCK_LSE=False)  # fmt: skip
    aligned = ("stride_qb", "stride_qh", "stride_sb", "stride_tb", "stride_th", "stride_ts")  # 4,096, 128, ...
    return Kernel(triton_decode._decode_split_kernel, signature, constants, triton_decode.SPLIT_WARPS,
                  triton_decode.SPLIT_STAGES, aligned)  # fmt: skip


def _lookup_signature(fn: Any, int32_pointers: tuple[str, ...] = ()) -> dict[str, str]:
    """A lookup kernel's runtime arguments typed: its tables and lists are int64 (but `int32_pointers`),
    its counts and strides int32."""
    names = [param.name for param in fn.params if not param.is_constexpr]
    return {name: ("*i32" if name in int32_pointers else "*i64") if name.endswith("_ptr") else "i32" for name in names}


def append_kernel() -> Kernel:
    """The lookup's ordered listing of its misses (`ops.triton_resolve`'s claims, second launch) at
    B=16 x 32K: 16 programs of 256 entries per (layer, KV head) partition, early loads from 4,072 slots."""
    from sparseserve_hf.ops import triton_resolve

    fn = triton_resolve._append_kernel
    constants = dict(CHUNK=triton_resolve.ENTRIES_PER_PROGRAM, CHUNKS=16, EARLY=1024)
    return Kernel(fn, _lookup_signature(fn, ("chunk_counts_ptr",)), constants, 4)


def install_kernel() -> Kernel:
    """The lookup's install (`ops.triton_resolve`) of one partition of 4,072 slots, as the step launches it
    (the eviction order's upkeep in a launch of its own)."""
    from sparseserve_hf.ops import triton_resolve

    fn = triton_resolve._install_kernel
    constants = dict(BLOCK=triton_resolve.MAX_TILE, FREE_BLOCK=128, ORDER=False)
    return Kernel(fn, _lookup_signature(fn), constants, triton_resolve.MAX_WARPS)


KERNELS: dict[str, Callable[[], Kernel]] = {
    "channels": channels_kernel,
    "channels_mma": channels_mma_kernel,
    "combine": combine_kernel,
    "union": union_kernel,
    "decode": decode_kernel,
    "append": append_kernel,
    "install": install_kernel,
}


def build(kernel: Kernel, arch: int = ARCH) -> tuple[bytes, int]:
    """The cubin of `kernel` for sm_90 and the shared memory one program takes (bytes). As a launch
    would, every pointer and the `aligned_ints` are taken as multiples of 16 (bytes or units)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, signature = kernel.fn, kernel.signature
    typed = dict(signature) | {name: "constexpr" for name in kernel.constants}
    fixed = {(fn.arg_names.index(name),): value for name, value in kernel.constants.items()}
    aligned = [name for name, kind in signature.items() if kind.startswith("*") or name in kernel.aligned_ints]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=fn, signature=typed, constexprs=fixed, attrs=attrs)
    stages = {} if kernel.num_stages is None else {"num_stages": kernel.num_stages}
    options = {"num_warps": kernel.num_warps} | stages
    if kernel.max_registers is not None:
        options["maxnreg"] = kernel.max_registers
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return compiled.asm["cubin"], int(compiled.metadata.shared)


def report(cubin: bytes) -> dict[str, Any]:
    """registers, bytes spilled to the stack, instructions and their kinds (opcodes without modifiers),
    and each loop (a backward branch's body) with its own count and kinds."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = _run(tools / "cuobjdump", "--dump-resource-usage", str(path))
        sass = _run(tools / "nvdisasm", "-c", str(path))
    registers, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    if registers is None:
        raise RuntimeError(f"cuobjdump reported no register count:\n{usage}")
    lines = sass.splitlines()
    return {
        "registers": int(registers.group(1)),
        "stack_bytes": int(stack.group(1)) if stack else 0,  # per thread: registers spilled to local memory
        "instructions": sum(1 for line in lines if INSTRUCTION.match(line)),
        "kinds": dict(_kinds(lines).most_common()),
        "loops": _loops(lines),
    }


SM_REGISTERS = 65536  # per SM on sm_90
SM_SHARED_BYTES = 227 * 1024  # the most shared memory the programs on one sm_90 SM can hold
SM_THREADS = 2048


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int) -> int:
    """Programs of one launch an sm_90 SM can hold at once: the fewest its registers (allocated per warp
    in units of 256), its shared memory (1 KiB reserved per program) and its threads allow."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM_REGISTERS // (per_warp * num_warps)
    by_shared = SM_SHARED_BYTES // (shared_bytes + 1024) if shared_bytes else SM_THREADS
    return min(by_registers, by_shared, SM_THREADS // (32 * num_warps))


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
    parser.add_argument("--stages", type=int, default=None, help="pipelining stages (default: the kernel's own)")
    parser.add_argument("--arch", type=int, default=ARCH, help="the compute capability built for, e.g. 80 (A100)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    kernel = KERNELS[args.kernel]()
    for knob in args.knob:
        name, _, value = knob.partition("=")
        if name not in kernel.constants or not value.lstrip("-").isdigit():
            raise ValueError(f"--knob {knob!r}: give NAME=INTEGER for one of {sorted(kernel.constants)}")
        kernel.constants[name] = int(value)
    kernel = replace(kernel, num_warps=args.warps or kernel.num_warps,
                     num_stages=kernel.num_stages if args.stages is None else args.stages)  # fmt: skip
    cubin, shared = build(kernel, args.arch)
    result = {"kernel": args.kernel, "triton": triton.__version__, "arch": f"sm_{args.arch}", "num_warps": kernel.num_warps,
              "num_stages": kernel.num_stages, "constants": kernel.constants, "shared_bytes": shared} | report(cubin)  # fmt: skip
    result["programs_per_sm"] = programs_per_sm(result["registers"], result["num_warps"], shared)
    print(f"{args.kernel}: Triton {triton.__version__}, sm_{args.arch}, {result['num_warps']} warps, "
          f"{result['registers']} registers ({result['stack_bytes']} bytes spilled), {shared} bytes of shared "
          f"memory ({result['programs_per_sm']} programs per SM at most), "
          f"{result['instructions']} instructions")  # fmt: skip
    for number, loop in enumerate(result["loops"]):
        top = ", ".join(f"{kind} {count}" for kind, count in list(loop["kinds"].items())[:10])
        print(f"  loop {number}: {loop['instructions']} instructions ({top})")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
