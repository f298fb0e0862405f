"""HLO text parsing and loop trip counts, on a hand-written module whose answers are known."""
import pytest

from muajax.planning import hlo

# A 5-trip loop (an all-gather and an [8,16]x[16,16] dot in its body), a 4-trip loop that
# counts 1, 3, 5, 7 (step 2, like XLA's windowed einsums) and a loop whose condition is not a
# counter (unknown trips); a reduce-scatter and an async all-reduce outside the loops.
MODULE = """HloModule test, entry_computation_layout={(f32[8,16]{1,0})->f32[2,16]{1,0}}

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,16]{1,0:T(8,128)} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %c = f32[] constant(1)
  %w = f32[16,16]{1,0} broadcast(%c), dimensions={}
  %ag = f32[32,16]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %d = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%next, %d)
}

%cond (p.1: (s32[], f32[8,16])) -> pred[] {
  %p.1 = (s32[], f32[8,16]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%body2 (q: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %q = (s32[], f32[8,16]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %y = f32[8,16]{1,0} get-tuple-element(%q), index=1
  %two = s32[] constant(2)
  %jc = s32[] copy(%j)
  %next2 = s32[] add(%jc, %two)
  %cp = f32[8,16]{1,0} collective-permute(%y), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  ROOT %t2 = (s32[], f32[8,16]{1,0}) tuple(%next2, %cp)
}

%cond2 (q.1: (s32[], f32[8,16])) -> pred[] {
  %q.1 = (s32[], f32[8,16]{1,0}) parameter(0)
  %j.1 = s32[] get-tuple-element(%q.1), index=0
  %nine = s32[] constant(9)
  ROOT %lt2 = pred[] compare(%j.1, %nine), direction=LT
}

%cond3 (r.1: (s32[], f32[8,16])) -> pred[] {
  %r.1 = (s32[], f32[8,16]{1,0}) parameter(0)
  %k.1 = s32[] get-tuple-element(%r.1), index=0
  %lim = s32[] constant(3)
  %a = pred[] compare(%k.1, %lim), direction=LT
  %b = pred[] constant(true)
  ROOT %both = pred[] and(%a, %b)
}

%add (x.2: f32[], y.2: f32[]) -> f32[] {
  %x.2 = f32[] parameter(0)
  %y.2 = f32[] parameter(1)
  ROOT %s = f32[] add(%x.2, %y.2)
}

ENTRY %main (arg: f32[8,16]) -> f32[2,16] {
  %arg = f32[8,16]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %arg)
  %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body
  %start = s32[] constant(1)
  %out = f32[8,16]{1,0} get-tuple-element(%loop), index=1
  %init2 = (s32[], f32[8,16]{1,0}) tuple(%start, %out)
  %loop2 = (s32[], f32[8,16]{1,0}) while(%init2), condition=%cond2, body=%body2
  %loop3 = (s32[], f32[8,16]{1,0}) while(%loop2), condition=%cond3, body=%body
  %out3 = f32[8,16]{1,0} get-tuple-element(%loop3), index=1
  %ar = f32[8,16]{1,0} all-reduce-start(%out3), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add
  %ard = f32[8,16]{1,0} all-reduce-done(%ar)
  ROOT %rs = f32[2,16]{1,0} reduce-scatter(%ard), channel_id=4, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}
"""


def test_loops_and_multipliers():
    module = hlo.parse_module(MODULE)
    runs, loops, fused = hlo.multipliers(module)
    assert [(loop.computation, loop.trips) for loop in loops] == [("main", 5), ("main", 4), ("main", None)]
    assert runs == {"main": 1.0, "body": 6.0, "body2": 4.0}  # the unknown loop's body counts once
    assert hlo.multipliers(module, unknown_trips=3)[0]["body"] == 8.0
    assert fused == set()  # no fusions; the reducer `add` is not a program step


def test_shapes_and_instructions():
    assert hlo.array_sizes("(bf16[2,3]{1,0:T(8,128)(2,1)}, s32[], /*index=2*/pred[4])") == [12, 4, 4]
    assert hlo.dims_of("f32[8,16]{1,0}") == (8, 16)
    instr = hlo.parse_instruction('  ROOT %x.1 = (f32[2]{0}, u32[]) all-gather-start(%a, %b.2), dims={0}')
    assert (instr.name, instr.opcode, instr.operands, instr.is_root) == ("x.1", "all-gather-start", ["a", "b.2"], True)
    assert hlo.parse_instruction("  %c = s32[] constant(7)").args == "7"
    with pytest.raises(ValueError, match="ENTRY"):
        hlo.parse_module("HloModule empty")


def test_a_sparsecore_computation_ends_at_its_execution_thread_brace():
    # v5p lowers packed GRPO rows' scatter-adds to SparseCore computations, closed by
    # `}, execution_thread="sparsecore"` rather than a bare `}`
    text = """HloModule m

%region_0 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}, execution_thread="sparsecore"

ENTRY %main (p: f32[4]) -> f32[4] {
  ROOT %p = f32[4] parameter(0)
}
"""
    module = hlo.parse_module(text)
    assert module.entry == "main" and set(module.computations) == {"region_0", "main"}
