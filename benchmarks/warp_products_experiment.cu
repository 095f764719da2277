// A compile-only experiment (KERNEL_NOTES v44): the folded KIVI-2 decode loop with both products
// done per warp by mma.sync instead of per warpgroup by wgmma, as CUDA C++ with inline PTX.
// `benchmarks/warp_products_experiment.py` compiles it for sm_90a and counts its SASS; it is not
// a kernel of the library, and nothing runs it.
//
// What it asks: how many instructions a warp issues per 64 cached tokens, and with how many
// registers, when each warp takes 16 of a block's 64 tokens through both products on its own:
//   key product   S^T[16 tokens, 8 rows] = K codes [16, 128] . Q'^T [128, 8]   (8 x m16n8k16)
//   value product O^T[128 ch, 8 rows]   += V^T codes [128, 16] . P'^T [16, 8]  (8 x m16n8k16)
// KIVI's values have a scale and a minimum per token and 32-channel group, so P' depends on a
// channel's value group: four query rows (the padding rows 4-7 repeating them) leave an 8-column
// B operand room for two groups (columns 4 s + j: slot s), and an m-tile's rows (half-word r's
// field p) fall in two groups by the parity of r (2 (r % 2) + p / 4): two B operands per 16
// tokens, each row of the accumulator reading the columns of its own group's slot.
// The key codes are the A operand masked in place from two 64-bit loads (as the folded Mosaic
// kernel's key_operand="registers"), the value codes the A operand from one transposing matrix
// load (as its value_operand="matrix_loads"), Q' is built in registers from the queries and the
// group's key scales, and P' goes from the key product's accumulator to the value product's B
// operand by two register transposes (movmatrix), so nothing is staged in shared memory and no
// barrier joins the warps in the loop. The softmax takes a fixed reference per split and row
// (row_max="bound"'s fixed arm), so no warp needs another's scores; each warp keeps its own
// partial output and sums, added across the four warps once, after the loop. The ring of copies
// is shared: a slot's "full" barrier is waited for by every warp, its "empty" barrier counts one
// arrival per warp, and the warp that issues a slot's refill rotates with the block.
//
// The codes are laid out as the cache's planar words (`bit_packing`, 2-bit codes: a token's 128
// channels in 8 words, field f of word w holding channel 8 f + w at bit 2 f) and taken as
// `subnormal_codes` takes them; only the instruction count and the registers are read off.

#include <cuda_bf16.h>
#include <stdint.h>

#ifndef STAGES
#define STAGES 4
#endif
#ifndef TILES
#define TILES 1  // 16-token tiles each warp takes per block: a block is 4 x 16 x TILES tokens
#endif
#ifndef UNROLL
#define UNROLL 1
#endif
#ifndef COPIES
#define COPIES 1  // 0 leaves the refills out of the loop (to count their share)
#endif
#ifndef RING_RELEASE
#define RING_RELEASE 1  // 1: each warp arrives on the slot's "empty" barrier; 0: a CTA barrier per
                        // block, after which the first warp refills the slot (as the folded Mosaic
                        // kernel's copy_issuer="first_warp" does)
#endif
#ifndef LENGTH_MASK
#define LENGTH_MASK 1  // 0: no per-token length test in the loop (last block only)
#endif
#ifndef QUERY_F32
#define QUERY_F32 0  // 1: Q' = bf16(q_f32 * scale) (one rounding), 0: bf16x2 products (two)
#endif
#ifndef APPROX_EXP2
#define APPROX_EXP2 0  // 1: ex2.approx.ftz (no range fix-up), 0: exp2f as libdevice computes it
#endif

constexpr int BLOCKS_UNROLLED = UNROLL;
constexpr int HEAD_DIM = 128;
constexpr int WARPS = 4;
constexpr int WARP_TOKENS = 16 * TILES;
constexpr int BLOCK = WARPS * WARP_TOKENS;
constexpr int REAL_ROWS = 4;  // query rows of a KV head (the benchmark's 4 heads per KV head)
constexpr int WORDS_PER_TOKEN = HEAD_DIM * 2 / 32;
constexpr int GROUP = 32;  // tokens of a key group, channels of a value group
constexpr int GROUPS_PER_BLOCK = BLOCK / GROUP;
constexpr int VALUE_GROUPS = HEAD_DIM / GROUP;
// bytes the copies of one block bring: codes, key scales, value statistics, key bias
constexpr unsigned SLOT_BYTES = 2 * BLOCK * WORDS_PER_TOKEN * 4 + GROUPS_PER_BLOCK * HEAD_DIM * 2 +
                                2 * VALUE_GROUPS * BLOCK * 2 + GROUPS_PER_BLOCK * REAL_ROWS * 4;

struct __align__(128) Slot {
  uint32_t key_words[BLOCK * WORDS_PER_TOKEN];
  uint32_t value_words[BLOCK * WORDS_PER_TOKEN];
  __nv_bfloat16 k_scale[GROUPS_PER_BLOCK * HEAD_DIM];
  __nv_bfloat16 v_scale[VALUE_GROUPS][BLOCK];
  __nv_bfloat16 v_min[VALUE_GROUPS][BLOCK];
  float key_bias[GROUPS_PER_BLOCK * REAL_ROWS];  // q . k_min per key group and row (base 2)
};

struct Inputs {
  const uint32_t* key_words;    // [programs' rows, T, 8]
  const uint32_t* value_words;  // [rows, T, 8]
  const __nv_bfloat16* k_scale; // [rows, T / 32, 128]
  const __nv_bfloat16* v_scale; // [rows, 4, T]: per value group (group-major, as the folded kernel's)
  const __nv_bfloat16* v_min;   // [rows, 4, T]
  const float* key_bias;        // [rows, T / 32, 4]
  const float* queries;         // [rows, 4, 128], scaled to base-2 logits
  const float* reference;       // [rows, splits, 4]: each split's fixed softmax reference
  const int* lengths;           // [rows]
  float* out;                   // [rows, splits, 4, 128]
  float* sums;                  // [rows, splits, 4, 5]: sum of p, then of p v_min per value group
  int tokens;
  int splits;
};

__device__ __forceinline__ uint32_t smem_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void wait_barrier(uint64_t* barrier, uint32_t phase) {
  asm volatile(
    "{\n .reg .pred done;\n retry:\n"
    " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
    " @!done bra retry;\n}\n" ::"r"(smem_address(barrier)),
    "r"(phase)
    : "memory");
}

__device__ __forceinline__ void arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(barrier)) : "memory");
}

__device__ __forceinline__ void expect_bytes(uint64_t* barrier, uint32_t bytes) {
  asm volatile(
    "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(barrier)),
    "r"(bytes)
    : "memory");
}

__device__ __forceinline__ void copy(void* destination, const void* source, uint32_t bytes,
                                     uint64_t* barrier) {
  asm volatile(
    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
      smem_address(destination)),
    "l"(source), "r"(bytes), "r"(smem_address(barrier))
    : "memory");
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
    "{%0,%1,%2,%3};"
    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t transpose(uint32_t fragment) {
  uint32_t result;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(result) : "r"(fragment));
  return result;
}

__device__ __forceinline__ void load_matrices_transposed(uint32_t (&r)[4], const void* row) {
  asm volatile(
    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
    : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
    : "r"(smem_address(row)));
}

__device__ __forceinline__ uint32_t pack(float low, float high) {
  __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<uint32_t*>(&pair);
}

__device__ __forceinline__ float widen(__nv_bfloat16 value) { return __bfloat162float(value); }

// Code field p (0..3) of each half of a word, in place: code * 2^(2p - 133) as bf16 bits.
__device__ __forceinline__ uint32_t field(uint32_t word, int p) {
  return word & (0x00030003u << (2 * p));
}

// The 16 A-operand registers of one token from its two words: (k-tile, half) <- (word, field).
__device__ __forceinline__ void key_registers(uint32_t (&a)[16], uint2 words) {
  uint32_t high0 = words.x >> 8, high1 = words.y >> 8;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    a[p] = field(words.x, p);
    a[4 + p] = field(high0, p);
    a[8 + p] = field(words.y, p);
    a[12 + p] = field(high1, p);
  }
}

// One program of four warps per CTA; four CTAs per SM asked for (at most 128 registers).
extern "C" __global__ void __launch_bounds__(WARPS * 32, 4) warp_products(Inputs in) {
  __shared__ Slot ring[STAGES];
  __shared__ __align__(8) uint64_t full[STAGES];
  __shared__ __align__(8) uint64_t empty[STAGES];
  // the four warps' partial outputs, added after the loop, where the ring was
  static_assert(sizeof(float) * WARPS * REAL_ROWS * (HEAD_DIM + 4) <= sizeof(Slot) * STAGES);
  auto& totals = *reinterpret_cast<float(*)[WARPS][REAL_ROWS][HEAD_DIM + 4]>(ring);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int quad = lane % 4, row = lane / 4;  // B / C fragment column pair, A / C fragment row
  const int program_row = blockIdx.x, split = blockIdx.y;
  const int length = in.lengths[program_row];
  // whole blocks per split, so that no block crosses into the next split
  const int split_tokens = ((in.tokens + in.splits - 1) / in.splits + BLOCK - 1) / BLOCK * BLOCK;
  const int start = split * split_tokens;
  const int blocks = (min(split_tokens, max(length - start, 0)) + BLOCK - 1) / BLOCK;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(&full[s])));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(&empty[s])),
                   "r"(WARPS));
    }
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();

  const size_t token_base = static_cast<size_t>(program_row) * in.tokens + start;
  auto issue = [&](int block) {
    Slot& slot = ring[block % STAGES];
    uint64_t* barrier = &full[block % STAGES];
    const size_t token = token_base + static_cast<size_t>(block) * BLOCK;
    const size_t in_row = start + static_cast<size_t>(block) * BLOCK;  // the token within its row
    expect_bytes(barrier, SLOT_BYTES);
    copy(slot.key_words, in.key_words + token * WORDS_PER_TOKEN, sizeof(slot.key_words), barrier);
    copy(slot.value_words, in.value_words + token * WORDS_PER_TOKEN, sizeof(slot.value_words),
         barrier);
    copy(slot.k_scale, in.k_scale + token / GROUP * HEAD_DIM, sizeof(slot.k_scale), barrier);
#pragma unroll
    for (int group = 0; group < VALUE_GROUPS; ++group) {
      const size_t statistics = (static_cast<size_t>(program_row) * VALUE_GROUPS + group) * in.tokens + in_row;
      copy(slot.v_scale[group], in.v_scale + statistics, sizeof(slot.v_scale[group]), barrier);
      copy(slot.v_min[group], in.v_min + statistics, sizeof(slot.v_min[group]), barrier);
    }
    copy(slot.key_bias, in.key_bias + token / GROUP * REAL_ROWS, sizeof(slot.key_bias), barrier);
  };
  if (warp == 0 && lane == 0) {
    for (int block = 0; block < min(blocks, STAGES); ++block) issue(block);
  }

  // This lane's queries at its B-fragment positions: row `row` % 4 (the padding rows repeat the
  // real ones), the channels of its key registers (register i: word w = 2 quad + i / 8, fields
  // f = i % 8 and f + 8, i.e. channels 8 f + w and 8 f + 64 + w), times 2^(69 - bit of the
  // field) as `subnormal_codes` scales them.
  const float* q = in.queries + (static_cast<size_t>(program_row) * REAL_ROWS + row % REAL_ROWS) * HEAD_DIM;
#if QUERY_F32
  float query[32];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int word = 2 * quad + i / 8, f = i % 8;
    query[2 * i] = q[8 * f + word] * exp2f(69.f - 2 * (f % 4));
    query[2 * i + 1] = q[8 * f + 64 + word] * exp2f(69.f - 2 * (f % 4));
  }
#else
  uint32_t query[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int word = 2 * quad + i / 8, f = i % 8;
    query[i] = pack(q[8 * f + word] * exp2f(69.f - 2 * (f % 4)),
                    q[8 * f + 64 + word] * exp2f(69.f - 2 * (f % 4)));
  }
#endif
  // The C fragment's columns 2 quad, 2 quad + 1: query rows 2 (quad % 2) + 0, 1, in slot quad / 2.
  const int column_row = 2 * (quad % 2), column_slot = quad / 2;
  const float* reference = in.reference + (static_cast<size_t>(program_row) * in.splits + split) * REAL_ROWS;
  const float reference0 = reference[column_row], reference1 = reference[column_row + 1];

  float output[8][4] = {};  // O^T: m-tile p (channels 16 h + ... + p), this lane's 4 entries
  float sum0 = 0.f, sum1 = 0.f;  // the lane's two columns
  float min_sums[2][2] = {};      // [B operand b][column]: value group 2 column_slot + b
  // Shared addresses computed once: the slots, and this lane's offsets in a slot.
  const uint32_t ring_base = smem_address(ring), full_base = smem_address(full);
  const int group = WARP_TOKENS * warp / GROUP;  // the key group of this warp's tokens

#pragma unroll BLOCKS_UNROLLED
  for (int block = 0; block < blocks; ++block) {
    const int stage = block % STAGES;
#if COPIES && RING_RELEASE
    // The warp whose turn it is refills the slot the previous block read, once every warp has
    // released it.
    if (block > 0 && warp == block % WARPS && block - 1 + STAGES < blocks && lane == 0) {
      const int previous = (block - 1) % STAGES;
      wait_barrier(&empty[previous], ((block - 1) / STAGES) & 1);
      issue(block - 1 + STAGES);
    }
#endif
    {
      const uint32_t barrier = full_base + 8 * stage, phase = (block / STAGES) & 1;
      asm volatile(
        "{\n .reg .pred done;\n retry:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra retry;\n}\n" ::"r"(barrier), "r"(phase) : "memory");
    }
    const Slot& slot = *reinterpret_cast<const Slot*>(
      __cvta_shared_to_generic(ring_base + stage * static_cast<uint32_t>(sizeof(Slot))));

    // Q' = q * k_scale for this lane's 32 channels of the group, paired as the codes are: the
    // scales of channels 8 k + 2 quad and 8 k + 2 quad + 1 are one word (k = 0..15).
    const uint32_t* scales = reinterpret_cast<const uint32_t*>(&slot.k_scale[group * HEAD_DIM]);
    uint32_t scale_words[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) scale_words[k] = scales[4 * k + quad];
    uint32_t scaled_query[16];  // (k-tile, half) order of key_registers
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int f = i % 8;
      const uint32_t pair = __byte_perm(scale_words[f], scale_words[f + 8], i / 8 ? 0x7632 : 0x5410);
#if QUERY_F32
      const float s0 = __uint_as_float(pair << 16), s1 = __uint_as_float(pair & 0xffff0000u);
      scaled_query[i] = pack(query[2 * i] * s0, query[2 * i + 1] * s1);
#else
      __nv_bfloat162 product = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&query[i]),
                                       *reinterpret_cast<const __nv_bfloat162*>(&pair));
      scaled_query[i] = *reinterpret_cast<uint32_t*>(&product);
#endif
    }
    const float2 bias = *reinterpret_cast<const float2*>(&slot.key_bias[group * REAL_ROWS + column_row]);
    const float shift0 = bias.x - reference0, shift1 = bias.y - reference1;

#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
      const int token0 = WARP_TOKENS * warp + 16 * tile + row;  // A rows: token0, token0 + 8
      // Key product: two accumulators over alternate k-tiles, for a shorter dependence chain.
      uint32_t a0[16], a1[16];
      key_registers(a0, *reinterpret_cast<const uint2*>(&slot.key_words[token0 * WORDS_PER_TOKEN + 2 * quad]));
      key_registers(a1, *reinterpret_cast<const uint2*>(&slot.key_words[(token0 + 8) * WORDS_PER_TOKEN + 2 * quad]));
      float even[4] = {}, odd[4] = {};
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint32_t a[4] = {a0[2 * k], a1[2 * k], a0[2 * k + 1], a1[2 * k + 1]};
        mma(k % 2 ? odd : even, a, scaled_query[2 * k], scaled_query[2 * k + 1]);
      }
      // the scores times 2^(133 - 69) (`subnormal_codes.SCORE_SCALE`), plus bias less reference
      constexpr float score_scale = 18446744073709551616.f;
      float logits[4] = {(even[0] + odd[0]) * score_scale + shift0,
                         (even[1] + odd[1]) * score_scale + shift1,
                         (even[2] + odd[2]) * score_scale + shift0,
                         (even[3] + odd[3]) * score_scale + shift1};
      float p[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#if APPROX_EXP2
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(p[i]) : "f"(logits[i]));
#else
        p[i] = exp2f(logits[i]);
#endif
      }
#if LENGTH_MASK
      const int token = start + block * BLOCK + token0;
      if (token >= length) p[0] = p[1] = 0.f;
      if (token + 8 >= length) p[2] = p[3] = 0.f;
#endif
      sum0 += p[0] + p[2], sum1 += p[1] + p[3];
      // P'^T as the value product's B operands, one per value group of this lane's slot (2 slot +
      // b), times 2^64 (`subnormal_codes.PROBS_SCALE`, which keeps the code products above f32's
      // subnormals): [token, column] pairs transposed to [column, token].
      uint32_t b0[2], b1[2];
      constexpr float probs_scale = 18446744073709551616.f;
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int value_group = 2 * column_slot + b;
        const float v_scale0 = widen(slot.v_scale[value_group][token0]) * probs_scale;
        const float v_scale1 = widen(slot.v_scale[value_group][token0 + 8]) * probs_scale;
        const float v_min0 = widen(slot.v_min[value_group][token0]);
        const float v_min1 = widen(slot.v_min[value_group][token0 + 8]);
        min_sums[b][0] += p[0] * v_min0 + p[2] * v_min1;
        min_sums[b][1] += p[1] * v_min0 + p[3] * v_min1;
        b0[b] = transpose(pack(p[0] * v_scale0, p[1] * v_scale0));
        b1[b] = transpose(pack(p[2] * v_scale1, p[3] * v_scale1));
      }

      // Value product: V^T from one transposing matrix load of the tile's 16 tokens.
      uint32_t v[4];
      const int matrix = lane / 8;
      load_matrices_transposed(
        v, &slot.value_words[(WARP_TOKENS * warp + 16 * tile + 8 * (matrix / 2) + lane % 8) * WORDS_PER_TOKEN + 4 * (matrix % 2)]);
      if (tile == TILES - 1) {  // the warp's last read of the slot is above: release it
#if RING_RELEASE
        __syncwarp();
        if (lane == 0) arrive(&empty[stage]);
#else
        __syncthreads();
#if COPIES
        if (warp == 0 && lane == 0 && block + STAGES < blocks) issue(block + STAGES);
#endif
#endif
      }
      const uint32_t v_high[4] = {v[0] >> 8, v[1] >> 8, v[2] >> 8, v[3] >> 8};
#pragma unroll
      for (int p_field = 0; p_field < 8; ++p_field) {
        const uint32_t* source = p_field < 4 ? v : v_high;
        const uint32_t a[4] = {field(source[0], p_field % 4), field(source[1], p_field % 4),
                               field(source[2], p_field % 4), field(source[3], p_field % 4)};
        mma(output[p_field], a, b0[p_field / 4], b1[p_field / 4]);
      }
    }
  }

  // After the loop: the four warps' partial outputs and sums added (once per split).
  __syncthreads();
#pragma unroll
  for (int tile = 0; tile < 8; ++tile) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // accumulator row r of m-tile `tile` is half-word r's field `tile` (half-word r: word r / 2,
      // fields 8 (r % 2) + 0..7; field f of word w: channel 8 f + w), in value group
      // 2 (r % 2) + tile / 4: it reads the columns of slot r % 2
      const int half_word = row + 8 * (i / 2);
      if (half_word % 2 == column_slot) {
        const int channel = 8 * (8 * (half_word % 2) + tile) + half_word / 2;
        totals[warp][column_row + i % 2][channel] = output[tile][i];
      }
    }
  }
  __syncthreads();
  float* out = in.out + (static_cast<size_t>(program_row) * in.splits + split) * REAL_ROWS * HEAD_DIM;
  for (int i = threadIdx.x; i < REAL_ROWS * HEAD_DIM; i += WARPS * 32) {
    const int query_row = i / HEAD_DIM, channel = i % HEAD_DIM;
    out[i] = totals[0][query_row][channel] + totals[1][query_row][channel] +
             totals[2][query_row][channel] + totals[3][query_row][channel];
  }
#pragma unroll
  for (int offset = 4; offset < 32; offset *= 2) {
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, offset);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, offset);
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      min_sums[b][0] += __shfl_xor_sync(0xffffffffu, min_sums[b][0], offset);
      min_sums[b][1] += __shfl_xor_sync(0xffffffffu, min_sums[b][1], offset);
    }
  }
  if (row == 0) {  // lanes 0-3: quad 0, 1 hold rows 0-1, 2-3 of slot 0 (groups 0, 1), 2-3 slot 1
    float* sums = in.sums + (static_cast<size_t>(program_row) * in.splits + split) * REAL_ROWS *
                              (1 + VALUE_GROUPS);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float* row_sums = sums + (column_row + c) * (1 + VALUE_GROUPS);
      if (column_slot == 0) atomicAdd(&row_sums[0], c ? sum1 : sum0);
#pragma unroll
      for (int b = 0; b < 2; ++b) atomicAdd(&row_sums[1 + 2 * column_slot + b], min_sums[b][c]);
    }
  }
}
