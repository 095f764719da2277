"""The SASS reading of benchmarks/triton_static_cost.py (text only: no triton, no GPU)."""

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).parents[2] / "benchmarks" / "triton_static_cost.py"
_SPEC = importlib.util.spec_from_file_location("triton_static_cost", _PATH)
static_cost = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(static_cost)

# Shaped like `cuobjdump -sass` output: a prologue, a loop from 0x0020 to 0x0080, an epilogue.
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   LDS.128 R4, [R2] ;                     /* 0x0000000002047984 */
        /*0030*/                   STS.U16 [R3], R5 ;                     /* 0x0000000503007388 */
        /*0040*/                   LDSM.16.M88.4 R8, [R2+0x10] ;          /* 0x000010000208783b */
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;          /* 0x0000000000007b1d */
        /*0060*/                   HMMA.16816.F32.BF16 R12, R8, R4, R12 ; /* 0x000000040c0c723c */
        /*0070*/                   ISETP.GE.AND P0, PT, R0, 0x4, PT ;     /* 0x000000040000780c */
        /*0080*/               @!P0 BRA 0x20 ;                            /* 0xffffff9000008947 */
        /*0090*/                   STG.E [R6.64], R12 ;                   /* 0x0000000c06007986 */
        /*00a0*/                   EXIT ;                                 /* 0x000000000000794d */
        /*00b0*/                   BRA 0xb0;                              /* 0xfffffffc00fc7947 */
"""


def test_main_loop_is_the_backward_branch_region():
  body = static_cost.main_loop_instructions(static_cost.parse_sass(SASS))
  assert [opcode for opcode, _ in body] == [
    "LDS.128",
    "STS.U16",
    "LDSM.16.M88.4",
    "BAR.SYNC.DEFER_BLOCKING",
    "HMMA.16816.F32.BF16",
    "ISETP.GE.AND",
    "BRA",
  ]


# Two loops, as the warp Mosaic GPU kernel has (one per softmax path): 0x20-0x50 without FMNMX,
# 0x60-0xb0 (the longer) with it.
TWO_LOOPS_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   LDS.128 R4, [R2] ;                     /* 0x0000000002047984 */
        /*0030*/                   HMMA.16816.F32.BF16 R12, R8, R4, R12 ; /* 0x000000040c0c723c */
        /*0040*/                   ISETP.GE.AND P0, PT, R0, 0x4, PT ;     /* 0x000000040000780c */
        /*0050*/               @!P0 BRA 0x20 ;                            /* 0xffffff9000008947 */
        /*0060*/                   LDS.128 R4, [R2] ;                     /* 0x0000000002047984 */
        /*0070*/                   FMNMX R5, R5, R4, !PT ;                /* 0x0000000405057209 */
        /*0080*/                   HMMA.16816.F32.BF16 R12, R8, R4, R12 ; /* 0x000000040c0c723c */
        /*0090*/                   FMUL R12, R12, R5 ;                    /* 0x0000000c0c0c7220 */
        /*00a0*/                   ISETP.GE.AND P0, PT, R0, 0x4, PT ;     /* 0x000000040000780c */
        /*00b0*/               @!P0 BRA 0x60 ;                            /* 0xffffff9000008947 */
        /*00c0*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_main_loop_without_an_opcode_is_the_longest_loop_lacking_it():
  instructions = static_cost.parse_sass(TWO_LOOPS_SASS)
  assert [a for a, _, _ in static_cost.main_loop(instructions)] == list(range(0x60, 0xC0, 0x10))
  fixed = static_cost.main_loop(instructions, without="FMNMX")
  assert [a for a, _, _ in fixed] == [0x20, 0x30, 0x40, 0x50]
  with pytest.raises(ValueError, match="every loop of the SASS has a HMMA instruction"):
    static_cost.main_loop(instructions, without="HMMA")


def test_loop_cost_counts_wavefronts_barriers_and_mma():
  cost = static_cost.loop_cost(
    "toy",
    SASS,
    "REG:72 STACK:0 SHARED:1024",
    "ttg.convert_layout ttg.convert_layout",
    tokens_per_iteration=32,
    warps=4,
  )
  assert (cost.instructions, cost.wavefronts, cost.barriers, cost.mma) == (7, 4 + 1 + 4, 1, 1)
  assert (cost.registers, cost.shared_bytes, cost.layout_conversions) == (72, 1024, 2)
  # 7 warp instructions x 32 lanes over 2 x 32 tokens x 128 channels / 4 warps elements.
  assert cost.per_element(128) == pytest.approx(7 * 32 / (2 * 32 * 128 / 4))
  floors = cost.floors_us(programs_tokens=32 * 132 * 4)
  # 132*4 iterations x 4 warps x 7 instructions over 132 SMs x 4 schedulers: 28 clocks.
  assert floors["issue_us"] == pytest.approx(28 / 1.755e9 * 1e6)
  assert floors["shared_us"] == pytest.approx(4 * 4 * 9 / 1.755e9 * 1e6)


def test_wgmma_shadows_count_what_is_issued_between_each_mma_and_its_wait():
  body = [
    ("FMUL", ""),  # before the first MMA: not in a shadow
    ("WARPGROUP.ARRIVE", ""),
    ("HGMMA.64x32x16.F32.BF16", ""),
    ("FFMA", ""),
    ("HGMMA.64x32x16.F32.BF16", ""),
    ("SHFL.BFLY", ""),
    ("BAR.SYNC.DEFER_BLOCKING", ""),
    ("WARPGROUP.DEPBAR.LE", ""),
    ("FADD", ""),
    ("WARPGROUP.ARRIVE", ""),
    ("HGMMA.64x16x16.F32.BF16", ""),
    ("WARPGROUP.DEPBAR.LE", ""),
    ("WARPGROUP.DEPBAR.LE", ""),  # a second wait opens no shadow
  ]
  assert static_cost.wgmma_shadows(body) == [3, 0]
  toy = static_cost.loop_cost("toy", SASS, "", "", tokens_per_iteration=32, warps=4)
  assert toy.wgmma_shadows == []  # an mma.sync loop has no warpgroup MMA


def test_a_listing_without_a_loop_is_refused():
  with pytest.raises(ValueError, match="no backward branch"):
    static_cost.main_loop_instructions(static_cost.parse_sass(SASS.replace("BRA 0x20", "BRA 0x90")))


def test_a_warpgroup_mma_costs_its_shared_memory_operands_once_per_warpgroup():
  # B [K 16, N 16] bf16 from shared memory: 512 bytes = 4 wavefronts per warpgroup, 1 per warp.
  assert static_cost.shared_memory_wavefronts(
    "HGMMA.64x16x16.F32.BF16", " R32, R56, gdesc[UR40], RZ, !UPT"
  ) == pytest.approx(1.0)
  # A [M 64, K 16] as well: 2048 more bytes.
  assert static_cost.shared_memory_wavefronts(
    "HGMMA.64x16x16.F32.BF16", " R32, gdesc[UR8], gdesc[UR40], R32"
  ) == pytest.approx(5.0)
  # tf32 operands are 4 bytes.
  assert static_cost.shared_memory_wavefronts(
    "HGMMA.64x32x8.F32.TF32", " R32, R56, gdesc[UR40], R32"
  ) == pytest.approx(32 * 8 * 4 / 128 / 4)
  assert static_cost.shared_memory_wavefronts("HMMA.16816.F32.BF16", " R12, R8, R4, R12") == 0


def test_a_warpgroup_mma_line_keeps_its_shape_in_the_opcode():
  line = (
    "        /*57a0*/                   HGMMA.64x16x16.F32.BF16 R32, R56, gdesc[UR40], RZ, !UPT ;"
    "     /* 0x0020002838207df0 */"
  )
  [(address, opcode, operands)] = static_cost.parse_sass(line)
  assert (address, opcode) == (0x57A0, "HGMMA.64x16x16.F32.BF16")
  assert static_cost.shared_memory_wavefronts(opcode, operands) == pytest.approx(1.0)


# A loop whose first warp alone runs 0x0050-0x0060: the warp index's low two bits tested into P1,
# a forward branch over the copies (as `pl.when(warp == 0)` inside `plgpu.warp_map` compiles).
WARP_MAP_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   ISETP.LE.AND P0, PT, R9, UR6, PT ;     /* 0x000000040000780c */
        /*0020*/                @P0 BRA 0x70 ;                            /* 0x0000000000008947 */
        /*0030*/                   SHFL.IDX PT, R2, R3, RZ, 0x1f ;        /* 0x0000000000007f89 */
        /*0040*/                   LOP3.LUT P1, RZ, R2, 0x3, RZ, 0xc0, !PT ; /* 0x0 */
        /*0050*/                @P1 BRA 0x70 ;                            /* 0x0000000000008947 */
        /*0060*/                   UTMALDG.4D [UR8], [UR20] ;             /* 0x0000000000007f89 */
        /*0070*/                   HGMMA.64x8x16.F32.BF16 R12, R8, gdesc[UR4], R12 ; /* 0x0 */
        /*0080*/                   ISETP.GE.AND P0, PT, R0, 0x4, PT ;     /* 0x000000040000780c */
        /*0090*/               @!P0 BRA 0x10 ;                            /* 0xffffff9000008947 */
        /*00a0*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_instructions_only_the_first_warp_runs_are_counted_apart():
  loop = static_cost.main_loop(static_cost.parse_sass(WARP_MAP_SASS))
  assert len(loop) == 9 and static_cost.first_warp_only(loop) == 1
  cost = static_cost.loop_cost(
    "warp map", WARP_MAP_SASS, "REG:64", "", tokens_per_iteration=64, warps=4
  )
  assert (cost.instructions, cost.first_warp_only) == (9, 1)
  assert cost.mean_instructions == 9 - 3 / 4
  # the other forward branch (the block-count test) guards no warp: nothing counted for it
  assert static_cost.first_warp_only(static_cost.main_loop(static_cost.parse_sass(SASS))) == 0


# A loop (0x0020-0x00b0) whose body is an if/else: the branch at 0x0030 to the else arm at
# 0x0070, the then arm (0x0040-0x0060) jumping to the join at 0x00a0; a forward branch inside the
# then arm (0x0040, skipping 0x0050) is not the if/else.
BRANCH_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   LDS.128 R4, [R2] ;                     /* 0x0000000002047984 */
        /*0030*/               @!P1 BRA 0x70 ;                            /* 0xffffff9000008947 */
        /*0040*/                @P2 BRA 0x60 ;                            /* 0xffffff9000008947 */
        /*0050*/                   FMUL R5, R5, R4 ;                      /* 0x0000000405057220 */
        /*0060*/                   BRA 0xa0 ;                             /* 0xffffff9000008947 */
        /*0070*/                   FMNMX R5, R5, R4, !PT ;                /* 0x0000000405057209 */
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;          /* 0x0000000000007b1d */
        /*0090*/                   FMUL R5, R5, R4 ;                      /* 0x0000000405057220 */
        /*00a0*/                   STS [R3], R5 ;                         /* 0x0000000503007388 */
        /*00b0*/               @!P0 BRA 0x20 ;                            /* 0xffffff9000008947 */
        /*00c0*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_branch_paths_are_each_arm_between_the_shared_parts():
  loop = static_cost.main_loop(static_cost.parse_sass(BRANCH_SASS))
  then_path, else_path = static_cost.branch_paths(loop)
  assert [address for address, _, _ in then_path] == [0x20, 0x30, 0x40, 0x50, 0x60, 0xA0, 0xB0]
  assert [address for address, _, _ in else_path] == [0x20, 0x30, 0x70, 0x80, 0x90, 0xA0, 0xB0]
  cost = static_cost.loop_cost(
    "toy", BRANCH_SASS, "REG:40", "", tokens_per_iteration=64, warps=4, branch_arm=1
  )
  assert (cost.instructions, cost.barriers) == (7, 1)


def test_a_loop_without_an_if_else_has_no_branch_paths():
  with pytest.raises(ValueError, match="no two-armed branch"):
    static_cost.branch_paths(static_cost.main_loop(static_cost.parse_sass(SASS)))


# A loop (0x0020-0x00f0) in which warps take their own branches: the warp index shuffled into
# R5 and masked; the first warp alone runs 0x0060-0x0070, the third alone 0x00a0; a barrier
# wait's retry branch (0x00c0, out of line past the EXIT) is not taken.
WARP_PATHS_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   SHFL.IDX PT, R5, R3, RZ, 0x1f ;        /* 0x00001fff03057589 */
        /*0030*/                   LOP3.LUT R6, R5, 0x3, RZ, 0xc0, !PT ;  /* 0x0000000305067812 */
        /*0040*/                   LOP3.LUT P0, RZ, R5, 0x3, RZ, 0xc0, !PT ; /* 0x0 */
        /*0050*/                @P0 BRA 0x80 ;                            /* 0x0000000000080947 */
        /*0060*/                   UTMALDG.4D [UR8], [UR10] ;             /* 0x00000008ff0075b4 */
        /*0070*/                   NOP ;                                  /* 0x0000000000007918 */
        /*0080*/                   ISETP.NE.U32.AND P1, PT, R6, 0x2, PT ; /* 0x000000020600780c */
        /*0090*/                @P1 BRA 0xb0 ;                            /* 0x0000000000041947 */
        /*00a0*/                   UTMALDG.4D [UR12], [UR14] ;            /* 0x0000000cff0075b4 */
        /*00b0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR6], R4 ; /* 0x0 */
        /*00c0*/               @!P2 BRA 0x110 ;                           /* 0x0000000000108947 */
        /*00d0*/                   FADD R7, R7, R8 ;                      /* 0x0000000807077221 */
        /*00e0*/                   ISETP.GE.AND P3, PT, R0, 0x4, PT ;     /* 0x000000040000780c */
        /*00f0*/               @!P3 BRA 0x20 ;                            /* 0xffffff9000008947 */
        /*0100*/                   EXIT ;                                 /* 0x000000000000794d */
        /*0110*/                   BRA 0xb0 ;                             /* 0xffffff9000007947 */
"""


def test_each_warp_path_takes_the_warp_index_branches_as_that_warp_does():
  assert static_cost.warp_path_lengths(WARP_PATHS_SASS) == [13, 11, 12, 11]
  cost = static_cost.loop_cost(
    "warp paths", WARP_PATHS_SASS, "REG:64", "", tokens_per_iteration=64, warps=4
  )
  assert cost.instructions == 14
  cost.warp_instructions = static_cost.warp_path_lengths(WARP_PATHS_SASS)
  assert cost.mean_instructions == (13 + 11 + 12 + 11) / 4
  # the first-warp listing above: its one skipped instruction, for the other three warps
  assert static_cost.warp_path_lengths(WARP_MAP_SASS) == [9, 8, 8, 8]


# A loop (0x0020-0x00b0) whose copies (0x0060-0x0080) the warp chosen per iteration runs: the
# warp index shuffled into R5 and compared with a uniform register (warp == slot % 4).
CHOSEN_WARP_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   SHFL.IDX PT, R5, R3, RZ, 0x1f ;        /* 0x00001fff03057589 */
        /*0030*/                   FADD R7, R7, R8 ;                      /* 0x0000000807077221 */
        /*0040*/                   ISETP.NE.U32.AND P2, PT, R5, UR11, PT ; /* 0x0000000b0500720c */
        /*0050*/                @P2 BRA 0x90 ;                            /* 0x0000000000082947 */
        /*0060*/                   UTMALDG.4D [UR8], [UR10] ;             /* 0x00000008ff0075b4 */
        /*0070*/                   UTMALDG.4D [UR12], [UR14] ;            /* 0x0000000cff0075b4 */
        /*0080*/                   NOP ;                                  /* 0x0000000000007918 */
        /*0090*/                   FADD R9, R9, R8 ;                      /* 0x0000000809097221 */
        /*00a0*/                   ISETP.GE.AND P3, PT, R0, 0x4, PT ;     /* 0x000000040000780c */
        /*00b0*/               @!P3 BRA 0x20 ;                            /* 0xffffff9000008947 */
        /*00c0*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_a_warp_chosen_per_iteration_runs_its_branch_on_its_share_of_the_slots():
  """Unresolved, the comparison with a uniform register counts the copies for every warp; the
  chosen (True) and other (False) paths differ by them, and over 4 stages each warp runs them a
  quarter of the iterations (over 2, warps 0 and 1 half of them, 2 and 3 never)."""
  assert static_cost.warp_path_lengths(CHOSEN_WARP_SASS) == [10] * 4
  assert static_cost.warp_path_lengths(CHOSEN_WARP_SASS, chosen=True) == [10] * 4
  assert static_cost.warp_path_lengths(CHOSEN_WARP_SASS, chosen=False) == [7] * 4
  assert static_cost.slot_owner_warp_lengths(CHOSEN_WARP_SASS, stages=4) == [7.75] * 4
  assert static_cost.slot_owner_warp_lengths(CHOSEN_WARP_SASS, stages=2) == [8.5, 8.5, 7, 7]
  assert static_cost.slot_owner_warp_lengths(CHOSEN_WARP_SASS, stages=3) == [8, 8, 8, 7]


def test_warp_paths_follow_one_arm_of_an_if_else():
  """Given an arm's path, the if's branch goes where that arm is; other predicated branches
  (here the then arm's inner one) are not taken."""
  loop = static_cost.main_loop(static_cost.parse_sass(BRANCH_SASS))
  then_path, else_path = static_cost.branch_paths(loop)
  assert static_cost.warp_path_lengths(BRANCH_SASS, then_path) == [7] * 4
  assert static_cost.warp_path_lengths(BRANCH_SASS, else_path) == [7] * 4


def test_warp_paths_refuse_an_indirect_branch():
  """A jump table (BRX) has targets the listing does not give: no count rather than a wrong one."""
  listing = WARP_PATHS_SASS.replace(
    "/*00d0*/                   FADD R7, R7, R8 ;", "/*00d0*/                   BRX R24 -0xe0 ;"
  )
  with pytest.raises(ValueError, match="an indirect branch at 0xd0"):
    static_cost.warp_path_lengths(listing)


# Shaped like `nvdisasm -lrm count` output: a header, instructions with their live counts.
LIVE_LISTING = """
                        // | GPR   | PRED   | UGPR   | UPRED   |
                        // |    #  |   #    |    #   |    #    |
        .text.kernel:   // |       |        |        |         |
        /*0000*/  MOV R1, c[0x0][0x28] ; // |    1  |        |        |         |
        /*0010*/  LDS.64 R4, [R2] ;      // |   37  |   1    |   2    |         |
        /*0020*/  HGMMA.64x16x16.F32.BF16 R24, R48, gdesc[UR8], RZ ; // |  107  |   6    |  31    |
        /*0030*/  FFMA R5, R4, R4, R5 ;  // |  107  |        |        |         |
        /*0040*/  EXIT ;                 // |    0  |        |        |         |
"""


def test_the_live_register_peak_is_the_first_instruction_holding_the_most():
  peak, where = static_cost.live_register_peak(LIVE_LISTING)
  assert peak == 107
  assert where == "0020: HGMMA.64x16x16.F32.BF16 R24, R48, gdesc[UR8], RZ"


def test_a_listing_without_live_counts_is_refused():
  with pytest.raises(ValueError, match="no instruction with a live-register count"):
    static_cost.live_register_peak(SASS)
