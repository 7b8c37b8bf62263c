// SM90 pipeline building blocks of the csrc kernels: mbarriers (a stage ring's full / empty
// signals, waited on by phase parity), named barriers between warpgroups, and register
// reallocation between a producer and its consumers. sm_90a device code only.
#pragma once

#include <cstdint>

#include "sm80_primitives.cuh"

namespace msa {
namespace sm90 {

// One mbarrier in shared memory. A phase completes when `count` arrivals (set by init) have
// happened; waiters name the phase they wait for by its parity (0, 1, 0, ...).
struct Mbarrier {
  uint64_t* bar;

  __device__ __forceinline__ uint32_t addr() const { return sm80::smem_addr(bar); }
  __device__ __forceinline__ void init(uint32_t count) const {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr()), "r"(count)
                 : "memory");
  }
  __device__ __forceinline__ void arrive() const {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(
                     addr())
                 : "memory");
  }
  // One arrival that also expects `bytes` more of bulk copies (complete_tx) in this phase: the
  // phase completes when its arrivals are in and those bytes have landed. sm_90+.
  __device__ __forceinline__ void arrive_expect_tx(uint32_t bytes) const {
    asm volatile(
        "{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::
            "r"(addr()),
        "r"(bytes)
        : "memory");
  }
  // Counts one arrival once every cp.async this thread has issued so far has landed (the
  // thread goes on at once; the arrival is one of the `count` init set).
  __device__ __forceinline__ void arrive_on_copies() const {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(addr())
                 : "memory");
  }
  // Blocks until the phase of parity `phase` has completed.
  __device__ __forceinline__ void wait(uint32_t phase) const {
    asm volatile(
        "{\n.reg .pred done;\nwait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(addr()),
        "r"(phase)
        : "memory");
  }
};

// Makes mbarrier.init visible to the other threads (and the async proxy) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Bulk copy (the TMA unit, no tensor map) of `bytes` (a multiple of 16; both addresses 16-byte
// aligned) from global to this CTA's shared memory, counted on `bar` as complete_tx. sm_90+.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes,
                                                    const Mbarrier& bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(sm80::smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(bar.addr())
      : "memory");
}

// A 2D tile of a tensor map (a CUtensorMap in param, const or global memory) at coordinates
// (x: innermost, y) into shared memory, counted on `bar` as complete_tx. sm_90+.
__device__ __forceinline__ void tma_load_2d(void* dst, const void* tensor_map, int x, int y,
                                            const Mbarrier& bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(sm80::smem_addr(dst)),
      "l"(tensor_map), "r"(x), "r"(y), "r"(bar.addr())
      : "memory");
}

// Orders this thread's earlier shared-memory accesses (generic proxy) before its later async-
// proxy ones: wgmma reading what cp.async or stores wrote, bulk copies into a stage that others
// have just read. sm_90+.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// A position in a ring of kStages stages: the stage index and the parity of the phase its full
// barrier completes next (the consumer's view; the producer waits for the empty barrier's
// previous phase, parity ^ 1, so its first pass over the ring does not wait).
template <int kStages>
struct RingState {
  int index = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1u;
    }
  }
};

// Named barrier `id` over `threads` threads: sync blocks until `threads` threads have synced or
// arrived; arrive counts this thread without waiting.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Per-thread register budget of the executing warpgroup (every warp of it executes it).
template <int kRegisters>
__device__ __forceinline__ void registers_down() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void registers_up() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace sm90
}  // namespace msa
