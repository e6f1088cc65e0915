"""The two NVIDIA architectures the TileLang CUDA generator serves, as data."""

from __future__ import annotations

from dataclasses import dataclass

WARP_GROUP = 128  # threads that issue one wgmma (sm90) or drain one TMEM tile (sm100)


@dataclass(frozen=True)
class Arch:
    name: str  # duotile target name
    sm: str  # nvcc / TileLang arch
    smem_bytes: int  # dynamic shared memory per block
    tmem_columns: int  # 0: no tensor memory; accumulators live in registers
    runnable_cc: tuple[int, int]  # compute capability a local GPU must have to run it
    mma_atom: tuple[int, int, int]  # (M, N, K bytes) of one wgmma / tcgen05 instruction
    modelled: bool  # no such GPU in this project: tuning ranks configs by the cost model
    sms: int = 0  # streaming multiprocessors: the block count of a persistent grid
    least_tile: int = 64  # rows of the least tile every MMA form takes (tcgen05's 64-row form needs N % 64)
    block_scaled_mma: bool = False  # tensor cores that apply UE8M0 block scales (block_scaled.py)
    threads_per_sm: int = 2048  # resident threads an SM holds at most (sm90 and sm100)

    @property
    def resident_threads(self) -> int:
        """Threads the whole chip holds at once: one wave of a launch."""
        return self.sms * self.threads_per_sm

    @property
    def has_tmem(self) -> bool:
        return self.tmem_columns > 0


SM90 = Arch("sm90", "sm_90a", 227 * 1024, 0, (9, 0), (64, 8, 32), False, sms=132)  # H100 / H200 SXM
# SM100: 228 KiB of shared memory per SM (227 usable per block) and 512 TMEM columns x 128 lanes x 32 bit.
SM100 = Arch("sm100", "sm_100a", 227 * 1024, 512, (10, 0), (64, 16, 32), True, sms=148, least_tile=128,
              block_scaled_mma=True)  # B200
