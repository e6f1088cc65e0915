# A prototype, not shipped: moe_gemm_mxfp4's main phase (phase 2 of 3) as duotile generated it for
# sm90 at the build case v41_w13_decode16 (E 384, N 4608, K 5120, ABLOCK 32; BM 64, BN 128, BK 128,
# STAGES 3), then edited by hand on 2026-12-04 to try a faster FP4 expansion:
#   * HELPER: eight e2m1 codes (a 32-bit word) to eight BF16 values times 2^(code - 127): each byte's
#     two codes placed as a BF16 pair by bit operations (the value times 2^-126), then two
#     mul.rn.bf16x2, by 2^126 and by the block's scale; one 16-byte store into the gemm's shared tile;
#   * the weights in natural K order (the helper writes element 2j from the low nibble of byte j),
#     so the activations are one contiguous (BM, BK) tile (TMA) and a trip runs one gemm, not two;
#   * the scale code read from global memory inside the expansion loop: read from the (BN, 1)
#     fragments instead, TileLang ran the loop on one of the two consumer warp groups.
# Compiled and counted offline (no GPU run yet):
#   python3 benchmarks/sass_loop.py --file benchmarks/prototypes/moe_p2_e2m1_helper.py:moe_gemm_mxfp4_p2_kernel
# kernel moe_gemm_mxfp4_p2  shapes {'E': 384, 'E1': 385, 'K': 5120, 'KA': 160, 'KH': 2560, 'KW': 160, 'N': 4608}  dynamic ['R']  config {'BM': 64, 'BN': 128, 'BK': 128, 'STAGES': 3, 'BE': 128}  constants {'ABLOCK': 32}
import tilelang
import tilelang.language as T

HELPER = r"""
// e2m1 x 8 -> bf16 x 8 times 2^(code - 127)
__device__ __forceinline__ unsigned duotile_mul_bf16x2(unsigned a, unsigned b) {
  unsigned d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ void duotile_e2m1x8_bf16(const void* src, void* dst, int code) {
  unsigned w = *reinterpret_cast<const unsigned*>(src);
  unsigned s = code == 255 ? 0x7FC0u : (code == 0 ? 0x0040u : (unsigned)code << 7);
  s |= s << 16;
  const unsigned lift = 0x7E807E80u;  // 2^126, both halves
  uint4 o;
  unsigned* r = reinterpret_cast<unsigned*>(&o);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    unsigned b = w >> (8 * k);
    unsigned bits = ((b & 0x7u) << 6) | ((b & 0x8u) << 12) | ((b & 0x70u) << 18) | ((b & 0x80u) << 24);
    r[k] = duotile_mul_bf16x2(duotile_mul_bf16x2(bits, lift), s);
  }
  *reinterpret_cast<uint4*>(dst) = o;
}
"""

PASS_CONFIGS = {'tl.device_compile_flags': ['--ftz=true']}  # TileLang pass options for this kernel
n_R = T.dynamic("n_R")  # the size R: one build serves every value


@T.prim_func
def moe_gemm_mxfp4_p2_kernel(a: T.Tensor((n_R, 5120,), "float8_e4m3"), a_scale: T.Tensor((n_R, 160,), "uint8"), w: T.Tensor((384, 4608, 2560,), "uint8"), w_scale: T.Tensor((384, 4608, 160,), "uint8"), counts: T.Tensor((384,), "int32"), offsets: T.Tensor((385,), "int32"), out: T.Tensor((n_R, 4608,), "bfloat16"), starts: T.Tensor((385,), "int32"), owner: T.Tensor(((T.ceildiv(n_R, 64) + T.min(384, n_R)),), "int32")):
    with T.Kernel((36 * T.ceildiv(n_R, 64) + 36 * T.min(384, n_R)), threads=256) as (grid_id,):
        T.import_source(HELPER)
        n = grid_id % 36
        t = grid_id // 36
        starts0_local = T.alloc_local((1,), "int32")
        t1_local = T.alloc_local((1,), "bool")
        owner2_local = T.alloc_local((1,), "int32")
        t3_local = T.alloc_local((1,), "int32")
        e = T.alloc_var("int32")
        offsets4_local = T.alloc_local((1,), "int32")
        starts5_local = T.alloc_local((1,), "int32")
        t6_local = T.alloc_local((1,), "int32")
        t7_frag = T.alloc_fragment((64,), "int32")
        counts8_local = T.alloc_local((1,), "int32")
        t9_frag = T.alloc_fragment((64,), "int32")
        t10_local = T.alloc_local((1,), "int32")
        r0 = T.alloc_var("int32")
        buf11_frag = T.alloc_fragment((64, 128,), "float32")
        t12_local = T.alloc_local((1,), "int32")
        w_scale_next13_frag = T.alloc_fragment((128, 1,), "uint8")
        w_scale14_frag = T.alloc_fragment((128, 1,), "uint8")
        w_scale_next15_frag = T.alloc_fragment((128, 1,), "uint8")
        w_scale16_frag = T.alloc_fragment((128, 1,), "uint8")
        w_scale_next17_frag = T.alloc_fragment((128, 1,), "uint8")
        w_scale18_frag = T.alloc_fragment((128, 1,), "uint8")
        w_scale_next19_frag = T.alloc_fragment((128, 1,), "uint8")
        w_scale20_frag = T.alloc_fragment((128, 1,), "uint8")
        a_scale_next21_frag = T.alloc_fragment((64, 1,), "uint8")
        a_scale22_frag = T.alloc_fragment((64, 1,), "uint8")
        a_scale_next23_frag = T.alloc_fragment((64, 1,), "uint8")
        a_scale24_frag = T.alloc_fragment((64, 1,), "uint8")
        a_scale_next25_frag = T.alloc_fragment((64, 1,), "uint8")
        a_scale26_frag = T.alloc_fragment((64, 1,), "uint8")
        a_scale_next27_frag = T.alloc_fragment((64, 1,), "uint8")
        a_scale28_frag = T.alloc_fragment((64, 1,), "uint8")
        k_stop = T.alloc_var("int32")
        w_scale29_frag = T.alloc_fragment((128, 1,), "uint8")
        w_scale30_frag = T.alloc_fragment((128, 1,), "uint8")
        w_scale31_frag = T.alloc_fragment((128, 1,), "uint8")
        w_scale32_frag = T.alloc_fragment((128, 1,), "uint8")
        a_scale33_frag = T.alloc_fragment((64, 1,), "uint8")
        a_scale34_frag = T.alloc_fragment((64, 1,), "uint8")
        a_scale35_frag = T.alloc_fragment((64, 1,), "uint8")
        a_scale36_frag = T.alloc_fragment((64, 1,), "uint8")
        w37_smem = T.alloc_shared((128, 64,), "uint8")
        t39_frag = T.alloc_fragment((64, 128,), "int32")
        t40_frag = T.alloc_fragment((64, 128,), "float32")
        a_smem = T.alloc_shared((64, 128,), "float8_e4m3")
        t43_frag = T.alloc_fragment((64, 128,), "bfloat16")
        wv_smem = T.alloc_shared((128, 128,), "bfloat16")
        t49_frag = T.alloc_fragment((64, 128,), "bfloat16")
        starts0_local[0] = T.if_then_else((384 < 385), starts[384], 0)  # moe_gemm_mxfp4.py:167
        t1_local[0] = (starts0_local[0] > t)  # moe_gemm_mxfp4.py:167
        owner2_local[0] = T.if_then_else((t < (T.ceildiv(n_R, 64) + T.min(384, n_R))), owner[t], 0)  # moe_gemm_mxfp4.py:168
        t3_local[0] = T.if_then_else(t1_local[0], owner2_local[0], 0)  # moe_gemm_mxfp4.py:168
        e = t3_local[0]  # moe_gemm_mxfp4.py:168
        offsets4_local[0] = T.if_then_else(T.And((e < 385), (e >= 0)), offsets[e], 0)  # moe_gemm_mxfp4.py:169
        starts5_local[0] = T.if_then_else(T.And((e < 385), (e >= 0)), starts[e], 0)  # moe_gemm_mxfp4.py:170
        t6_local[0] = (offsets4_local[0] + ((t - starts5_local[0]) * 64))  # moe_gemm_mxfp4.py:170
        for i0 in T.Parallel(64):
            t7_frag[i0] = (t6_local[0] + i0)  # moe_gemm_mxfp4.py:171
        counts8_local[0] = T.if_then_else(T.And((e < 384), (e >= 0)), counts[e], 0)  # moe_gemm_mxfp4.py:172
        for i0 in T.Parallel(64):
            t9_frag[i0] = T.if_then_else(T.And(t1_local[0], (t7_frag[i0] < (offsets4_local[0] + counts8_local[0]))), t7_frag[i0], -1)  # moe_gemm_mxfp4.py:172
        t10_local[0] = T.if_then_else(t1_local[0], t6_local[0], 0)  # moe_gemm_mxfp4.py:175
        r0 = t10_local[0]  # moe_gemm_mxfp4.py:175
        T.clear(buf11_frag)  # moe_gemm_mxfp4.py:177
        t12_local[0] = T.cast(T.if_then_else(t1_local[0], 40, 0), "int32")  # moe_gemm_mxfp4.py:178
        T.copy(w_scale[e, 128 * n:128 * n + 128, 0:1], w_scale14_frag)  # moe_gemm_mxfp4.py:115
        for i0, i1 in T.Parallel(128, 1):
            w_scale_next13_frag[i0, i1] = w_scale14_frag[i0, 0]  # moe_gemm_mxfp4.py:115
        T.copy(w_scale[e, 128 * n:128 * n + 128, 1:1 + 1], w_scale16_frag)  # moe_gemm_mxfp4.py:117
        for i0, i1 in T.Parallel(128, 1):
            w_scale_next15_frag[i0, i1] = w_scale16_frag[i0, 0]  # moe_gemm_mxfp4.py:117
        T.copy(w_scale[e, 128 * n:128 * n + 128, 2:2 + 1], w_scale18_frag)  # moe_gemm_mxfp4.py:117
        for i0, i1 in T.Parallel(128, 1):
            w_scale_next17_frag[i0, i1] = w_scale18_frag[i0, 0]  # moe_gemm_mxfp4.py:117
        T.copy(w_scale[e, 128 * n:128 * n + 128, 3:3 + 1], w_scale20_frag)  # moe_gemm_mxfp4.py:117
        for i0, i1 in T.Parallel(128, 1):
            w_scale_next19_frag[i0, i1] = w_scale20_frag[i0, 0]  # moe_gemm_mxfp4.py:117
        T.copy(a_scale[r0:r0 + 64, 0:1], a_scale22_frag)  # moe_gemm_mxfp4.py:115
        for i0, i1 in T.Parallel(64, 1):
            a_scale_next21_frag[i0, i1] = a_scale22_frag[i0, 0]  # moe_gemm_mxfp4.py:115
        T.copy(a_scale[r0:r0 + 64, 1:1 + 1], a_scale24_frag)  # moe_gemm_mxfp4.py:117
        for i0, i1 in T.Parallel(64, 1):
            a_scale_next23_frag[i0, i1] = a_scale24_frag[i0, 0]  # moe_gemm_mxfp4.py:117
        T.copy(a_scale[r0:r0 + 64, 2:2 + 1], a_scale26_frag)  # moe_gemm_mxfp4.py:117
        for i0, i1 in T.Parallel(64, 1):
            a_scale_next25_frag[i0, i1] = a_scale26_frag[i0, 0]  # moe_gemm_mxfp4.py:117
        T.copy(a_scale[r0:r0 + 64, 3:3 + 1], a_scale28_frag)  # moe_gemm_mxfp4.py:117
        for i0, i1 in T.Parallel(64, 1):
            a_scale_next27_frag[i0, i1] = a_scale28_frag[i0, 0]  # moe_gemm_mxfp4.py:117
        k_stop = t12_local[0]  # moe_gemm_mxfp4.py:179
        for k in T.Pipelined(0, T.min(40, k_stop), num_stages=3):
            T.copy(w_scale[e, 128 * n:128 * n + 128, (4 * k + 4):(4 * k + 4) + 1], w_scale29_frag)  # moe_gemm_mxfp4.py:115
            T.copy(w_scale[e, 128 * n:128 * n + 128, (4 * k + 5):(4 * k + 5) + 1], w_scale30_frag)  # moe_gemm_mxfp4.py:117
            T.copy(w_scale[e, 128 * n:128 * n + 128, (4 * k + 6):(4 * k + 6) + 1], w_scale31_frag)  # moe_gemm_mxfp4.py:117
            T.copy(w_scale[e, 128 * n:128 * n + 128, (4 * k + 7):(4 * k + 7) + 1], w_scale32_frag)  # moe_gemm_mxfp4.py:117
            T.copy(a_scale[r0:r0 + 64, (4 * k + 4):(4 * k + 4) + 1], a_scale33_frag)  # moe_gemm_mxfp4.py:115
            T.copy(a_scale[r0:r0 + 64, (4 * k + 5):(4 * k + 5) + 1], a_scale34_frag)  # moe_gemm_mxfp4.py:117
            T.copy(a_scale[r0:r0 + 64, (4 * k + 6):(4 * k + 6) + 1], a_scale35_frag)  # moe_gemm_mxfp4.py:117
            T.copy(a_scale[r0:r0 + 64, (4 * k + 7):(4 * k + 7) + 1], a_scale36_frag)  # moe_gemm_mxfp4.py:117
            T.copy(w[e, 128 * n:128 * n + 128, 64 * k:64 * k + 64], w37_smem)  # moe_gemm_mxfp4.py:181
            T.copy(a[r0:r0 + 64, 128 * k:128 * k + 128], a_smem)
            for i0, i1 in T.Parallel(64, 128):
                t39_frag[i0, i1] = T.cast(T.if_then_else((T.floordiv(i1, 32) == 3), a_scale_next27_frag[i0, 0], T.if_then_else((T.floordiv(i1, 32) == 2), a_scale_next25_frag[i0, 0], T.if_then_else((T.floordiv(i1, 32) == 1), a_scale_next23_frag[i0, 0], a_scale_next21_frag[i0, 0]))), "int32")
            for i0, i1 in T.Parallel(64, 128):
                t40_frag[i0, i1] = T.reinterpret(T.if_then_else((t39_frag[i0, i1] == 255), 2143289344, T.if_then_else((t39_frag[i0, i1] == 0), 4194304, T.shift_left(t39_frag[i0, i1], 23))), "float32")
            for i0, i1 in T.Parallel(64, 128):
                t43_frag[i0, i1] = T.cast((T.cast(a_smem[i0, i1], "float32") * t40_frag[i0, i1]), "bfloat16")
            for i0, j in T.Parallel(128, 16):
                T.call_extern("handle", "duotile_e2m1x8_bf16", T.address_of(w37_smem[i0, 4 * j]), T.address_of(wv_smem[i0, 8 * j]), T.cast(w_scale[e, 128 * n + i0, 4 * k + T.floordiv(j, 4)], "int32"))
            T.gemm(t43_frag, wv_smem, buf11_frag, transpose_A=False, transpose_B=True, clear_accum=k == 0)
            for i0, i1 in T.Parallel(128, 1):
                w_scale_next13_frag[i0, i1] = w_scale29_frag[i0, 0]  # moe_gemm_mxfp4.py:115
            for i0, i1 in T.Parallel(128, 1):
                w_scale_next15_frag[i0, i1] = w_scale30_frag[i0, 0]  # moe_gemm_mxfp4.py:117
            for i0, i1 in T.Parallel(128, 1):
                w_scale_next17_frag[i0, i1] = w_scale31_frag[i0, 0]  # moe_gemm_mxfp4.py:117
            for i0, i1 in T.Parallel(128, 1):
                w_scale_next19_frag[i0, i1] = w_scale32_frag[i0, 0]  # moe_gemm_mxfp4.py:117
            for i0, i1 in T.Parallel(64, 1):
                a_scale_next21_frag[i0, i1] = a_scale33_frag[i0, 0]  # moe_gemm_mxfp4.py:115
            for i0, i1 in T.Parallel(64, 1):
                a_scale_next23_frag[i0, i1] = a_scale34_frag[i0, 0]  # moe_gemm_mxfp4.py:117
            for i0, i1 in T.Parallel(64, 1):
                a_scale_next25_frag[i0, i1] = a_scale35_frag[i0, 0]  # moe_gemm_mxfp4.py:117
            for i0, i1 in T.Parallel(64, 1):
                a_scale_next27_frag[i0, i1] = a_scale36_frag[i0, 0]  # moe_gemm_mxfp4.py:117
        for i0, i1 in T.Parallel(64, 128):
            t49_frag[i0, i1] = T.cast(buf11_frag[i0, i1], "bfloat16")  # moe_gemm_mxfp4.py:191
        for i0, i1 in T.Parallel(64, 128):
            if T.And(T.And((t9_frag[i0] >= 0), (t9_frag[i0] < n_R)), (128 * n + i1 < 4608)):
                out[t9_frag[i0], 128 * n + i1] = t49_frag[i0, i1]  # moe_gemm_mxfp4.py:191
