"""FLOPs and HBM bytes of the Pallas TPU kernels in a compiled program, which XLA's cost
analysis and the dot count of `hlo_cost` both miss: a Pallas kernel is a `custom-call`
(target `tpu_custom_call`) whose body is a serialized Mosaic module, to XLA an opaque
call of 0 FLOPs and 0 bytes.

A kernel is recognised by the name of its Mosaic function, read from the serialized body
in the call's backend_config (the instruction's own name is a fallback), and costed from
its operand shapes with the kernel's own loop structure:

  splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`, which
  `muajax.models.splash_attention` calls): `splash_{mha,mqa}_{fwd,dq,dkv}...`. Each kernel
  visits the (q block, kv block) pairs its block mask does not zero, per query head and
  batch row, and runs per pair (bq x bkv x head_dim matmuls, read in the kernel source):
      fwd  2: s = q k^T, o += p v
      dq   3: s = q k^T, dp = do v^T, dq += ds k
      dkv  4: s = k q^T, dv += p do, dp = v do^T, dk += ds q  (+1, dq += ds k, when fused)
  The mask's blocks are compile-time constants that the compiled text elides, so the pairs
  are counted for a causal mask, the only mask muajax builds; the block sizes come from
  the kernel's metadata (frontend_attributes), whether dq is fused into dkv too. A query
  shard (context parallelism: q shorter than kv) is counted as the average shard.
  Bytes: what the kernel streams from HBM, the blocks of the inner grid axis once per
  computed pair (fwd and dq: k and v; dkv: q, do and the per-row residuals) and the rest
  once.

  ragged paged attention (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`, the
  engine's `muajax.engine.paged_attention`): `ragged_paged_attention_kernel`. For every
  (query block, sequence with queries in it) it runs every kv block of that sequence's
  kv_len, each query block whole whichever rows are the sequence's: 2 matmuls of
  (queries_per_block x heads) x kv_block x head_dim. Lengths are runtime values, so the
  compiled program gets the bound its static shapes allow (every sequence at the full
  page table, as many sequence/block pairs as the queries can make);
  `ragged_paged_flops(q_lens, kv_lens, ...)` is the same formula at real lengths. Block
  sizes: the engine's (`muajax.engine.paged_attention.DEFAULT_BLOCKS`), which the call's
  text does not carry.

  ragged dot (`jax.lax.ragged_dot`, the mixture of experts' grouped matmuls,
  `muajax.models.moe`): XLA:TPU lowers it to its own Mosaic kernel, `ragged-dot-*` (with a
  `ragged-dot-metadata` call that only counts the groups' tiles), and gives it a
  `cost_estimate` in its backend_config that XLA's cost analysis does count, once per
  computation like any instruction: FLOPs of the rows' own groups only (2 x rows x K x N),
  bytes of its operands (every group's weights) and result. That estimate is the cost,
  and since XLA counted one run, the caller adds only the runs beyond it
  (`KernelCost.xla_counted`). (Its weight gradient is no such kernel: XLA:TPU expands it to
  a convolution over every group, which the dot count sees as it is.)

XLA:TPU's own bookkeeping calls (`XLA_BOOKKEEPING`: buffer allocation, index annotations,
async-call markers)
run no matmuls and are left to XLA's counts. Any other custom call is returned as
unrecognised, for the caller to list as uncounted.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import re

from muajax.engine.paged_attention import DEFAULT_BLOCKS
from muajax.models.flops import causal_block_pairs
from muajax.planning.hlo import Instruction, array_sizes, dims_of

SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}  # per (q block, kv block) pair; dkv +1 fused
SPLASH_NAME = re.compile(r"splash_(mha|mqa)_(fwd|dq|dkv)(_segmented)?_(no_)?residuals")
RAGGED_NAME = "ragged_paged_attention_kernel"
RAGGED_DOT = re.compile(r"ragged-dot(-[a-z]+)?")  # XLA:TPU's ragged_dot kernel and its metadata call
_COST_ESTIMATE = re.compile(r'"cost_estimate":\{"flops":"(\d+)"[^}]*"bytes_accessed":"(\d+)"')
_BODY = re.compile(r'"body":"([A-Za-z0-9+/=]+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# PrepareAsyncCallStart/Done: the operand-less markers v5p's SparseCore scatter offload
# (the packed GRPO rows' scatter-adds) is started and joined with; the scatter is XLA's own.
XLA_BOOKKEEPING = frozenset({"AllocateBuffer", "AssumeGatherIndicesInBound", "GatherScatterIndicesBitpacked",
                             "PrepareAsyncCallStart", "PrepareAsyncCallDone", "ragged-dot-metadata"})
_INTS = ("s8", "s16", "s32", "s64", "u8", "u16", "u32", "u64", "pred")


@dataclasses.dataclass(frozen=True)
class KernelCost:
    name: str     # the kernel, e.g. splash_mha_fwd_residuals
    flops: float  # per call
    bytes: float  # HBM bytes read and written per call
    xla_counted: bool = False  # XLA's cost analysis already counts one run (its cost_estimate)


def target_of(instr: Instruction) -> str:
    m = _TARGET.search(instr.attrs)
    return m.group(1) if m else ""


def kernel_name(instr: Instruction) -> str:
    """The Mosaic function's name in the serialized body, else the instruction's name."""
    m = _BODY.search(instr.attrs)
    if m:
        try:
            body = base64.b64decode(m.group(1))
        except ValueError:
            body = b""
        for pattern in (SPLASH_NAME.pattern.encode(), RAGGED_NAME.encode()):
            found = re.search(pattern, body)
            if found:
                return found.group(0).decode()
    return re.sub(r"(\.\d+|\.clone)+$", "", instr.name)


# ----------------------------------------------------------------------------- splash


def splash_pairs(q_len: int, kv_len: int, block_q: int, block_kv: int, causal: bool = True) -> float:
    """Pairs one (row, head) computes; queries shorter than keys are one of kv_len / q_len
    query shards of the row, counted as their average."""
    if not causal:
        return float(-(-q_len // block_q) * -(-kv_len // block_kv))
    shards = max(kv_len // q_len, 1) if q_len < kv_len else 1
    return sum(causal_block_pairs(q_len, kv_len, block_q, block_kv, s * q_len) for s in range(shards)) / shards


def splash_flops(phase: str, *, q_len: int, kv_len: int, heads: int, head_dim: int, block_q: int, block_kv: int,
                 batch: int = 1, fused: bool = False, causal: bool = True) -> float:
    """FLOPs of one splash kernel call (`phase` fwd, dq or dkv) over `batch` rows of
    `heads` query heads: pairs x matmuls x 2 * block_q * block_kv * head_dim."""
    matmuls = SPLASH_MATMULS[phase] + (1 if phase == "dkv" and fused else 0)
    pairs = splash_pairs(q_len, kv_len, block_q, block_kv, causal)
    return batch * heads * pairs * matmuls * 2.0 * block_q * block_kv * head_dim


def splash_attention_flops(seq: int, *, heads: int, head_dim: int, block: int, batch: int = 1,
                           backward: bool = True, forwards: int = 1) -> float:
    """One causal splash attention over `batch` rows of `seq` tokens, as a step runs it:
    `forwards` forward kernels (2 under remat: the backward runs the forward again) and,
    with `backward`, the separate dq and dkv kernels (muajax's BlockSizes)."""
    args = dict(q_len=seq, kv_len=seq, heads=heads, head_dim=head_dim, block_q=block, block_kv=block, batch=batch)
    total = forwards * splash_flops("fwd", **args)
    if backward:
        total += splash_flops("dq", **args) + splash_flops("dkv", **args)
    return total


def _metadata_blocks(attrs: str) -> dict:
    m = re.search(r'xprof_metadata\\?"\s*:\s*"(\{.*?\})"', attrs, re.DOTALL)
    if not m:
        return {}
    try:
        return json.loads(m.group(1).replace('\\"', '"'))
    except json.JSONDecodeError:
        return {}


def _float_operands(instr: Instruction, shapes: dict[str, str]) -> list[str]:
    out = []
    for operand in instr.operands:
        shape = shapes.get(operand, "")
        if shape and not shape.lstrip("(").startswith(_INTS):
            out.append(shape)
    return out


def _splash(name: str, instr: Instruction, shapes: dict[str, str]) -> KernelCost | None:
    phase = SPLASH_NAME.match(name).group(2)
    blocks = _metadata_blocks(instr.attrs)
    floats = _float_operands(instr, shapes)
    if len(floats) < 3:
        return None
    suffix = {"fwd": "", "dq": "_dq", "dkv": "_dkv"}[phase]
    bq, bkv = blocks.get(f"block_q{suffix}"), blocks.get(f"block_kv{suffix}")
    if not bq or not bkv:
        return None
    q, k = dims_of(floats[0]), dims_of(floats[1])
    batch, heads, q_len, head_dim = math.prod(q[:-3]), q[-3], q[-2], q[-1]
    kv_len = k[-2]
    fused = bool(blocks.get("use_fused_bwd_kernel"))
    flops = splash_flops(phase, q_len=q_len, kv_len=kv_len, heads=heads, head_dim=head_dim, block_q=bq,
                         block_kv=bkv, batch=batch, fused=fused)
    pairs = batch * heads * splash_pairs(q_len, kv_len, bq, bkv)
    sizes = [sum(array_sizes(s)) for s in floats]
    if phase == "dkv":  # k and v once; q, do and the per-row residuals block by block per pair
        once = sizes[1] + sizes[2]
        streamed = pairs * bq * (sizes[0] + sum(sizes[3:])) / math.prod(q[:-1])
    else:  # fwd and dq: the queries' rows (and their residuals) once; k and v per pair
        once = sizes[0] + sum(sizes[3:])
        streamed = pairs * bkv * (sizes[1] + sizes[2]) / math.prod(k[:-1])
    written = sum(array_sizes(instr.shape))
    return KernelCost(name, flops, once + streamed + written)


# ----------------------------------------------------------------------------- ragged paged attention


def ragged_paged_flops(q_lens, kv_lens, *, heads: int, head_dim: int, queries_per_block: int,
                       kv_block: int) -> float:
    """FLOPs of one ragged paged attention call at real lengths: the sequences' queries
    packed in order (`q_lens`), each over its `kv_lens` keys."""
    pairs, start = 0, 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        if q_len <= 0:
            continue
        end = start + q_len
        blocks = (end - 1) // queries_per_block - start // queries_per_block + 1
        pairs += blocks * -(-kv_len // kv_block)
        start = end
    return pairs * 4.0 * queries_per_block * heads * kv_block * head_dim


def ragged_paged_bound(*, tokens: int, seqs: int, pages_per_seq: int, page_size: int, heads: int, head_dim: int,
                       queries_per_block: int, pages_per_block: int) -> tuple[float, int]:
    """(FLOPs, kv blocks read) of the most a call of these static shapes can compute: as
    many (query block, sequence) pairs as `tokens` queries in `seqs` sequences make
    (a sequence boundary inside a block adds one), each over a full page table."""
    q_blocks = -(-tokens // queries_per_block)
    pairs = q_blocks + min(seqs, tokens) - 1
    kv_blocks = pairs * -(-pages_per_seq // pages_per_block)
    return kv_blocks * 4.0 * queries_per_block * heads * pages_per_block * page_size * head_dim, kv_blocks


def _ragged(name: str, instr: Instruction, shapes: dict[str, str]) -> KernelCost | None:
    floats = [dims_of(s) for s in _float_operands(instr, shapes)]
    ints = [dims_of(shapes.get(o, "")) for o in instr.operands if shapes.get(o, "").startswith(_INTS)]
    q = next((d for d in floats if len(d) == 3), None)
    pool = next((d for d in floats if len(d) == 4), None)
    table = next((d for d in ints if len(d) == 2), None)
    if q is None or pool is None or table is None:
        return None
    tokens, heads, head_dim = q
    seqs, pages_per_seq = table
    page_size = pool[1]
    per_block = DEFAULT_BLOCKS.pages(page_size, pages_per_seq)
    flops, kv_blocks = ragged_paged_bound(tokens=tokens, seqs=seqs, pages_per_seq=pages_per_seq, page_size=page_size,
                                          heads=heads, head_dim=head_dim, pages_per_block=per_block,
                                          queries_per_block=min(DEFAULT_BLOCKS.queries_per_block, tokens))
    floats_bytes = [sum(array_sizes(s)) for s in _float_operands(instr, shapes)]
    q_bytes = floats_bytes[[len(d) for d in floats].index(3)]
    page_bytes = floats_bytes[[len(d) for d in floats].index(4)] / pool[0]
    return KernelCost(name, flops, q_bytes + sum(array_sizes(instr.shape)) + kv_blocks * per_block * page_bytes)


def _ragged_dot(name: str, instr: Instruction) -> KernelCost | None:
    """XLA:TPU's ragged-dot kernel at its own cost_estimate (the metadata call: none, 0)."""
    m = _COST_ESTIMATE.search(instr.attrs)
    if m is None:
        return KernelCost(name, 0.0, 0.0, xla_counted=True) if name == "ragged-dot-metadata" else None
    return KernelCost(name, float(m.group(1)), float(m.group(2)), xla_counted=True)


def custom_call_cost(instr: Instruction, shapes: dict[str, str]) -> tuple[str, KernelCost | None]:
    """(name, cost) of a custom call: its kernel name and cost, or None when unrecognised
    (an XLA bookkeeping call: its target and a cost of nothing)."""
    target = target_of(instr)
    if target in XLA_BOOKKEEPING:
        return target, KernelCost(target, 0.0, 0.0)
    if target != "tpu_custom_call":
        return target or instr.name, None
    name = kernel_name(instr)
    if SPLASH_NAME.match(name):
        return name, _splash(name, instr, shapes)
    if name == RAGGED_NAME:
        return name, _ragged(name, instr, shapes)
    if RAGGED_DOT.fullmatch(name):
        return name, _ragged_dot(name, instr)
    return name, None
