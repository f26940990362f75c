"""Host execution of the CUDA kernel sources.

The expanded ``kernels_cu`` source is built as host C++ by g++, one shared
library per dtype holding every GLU variant's entry points (the kernel files
as NVRTC compiles them, then each variant's entries exactly as in its own
module: one build instead of 28 amortizes the CUDA headers' parse), with a
small compatibility header that turns the grid into loops. ``HostLauncher``
implements the launcher interface, so the Python code that picks vector
widths, grids and arguments is the same as on a GPU.

:func:`build_host_library` builds any CUDA source this way (the kernels_cu
library and the executor's own tests use it), and
:meth:`HostLibrary.launch` runs one of its kernels, in one of two modes:

* **sequential**: each thread runs to completion, one after another. Faithful
  for kernels whose threads never cooperate, and the fastest.
* **fibers** (cooperative): each block's threads run as fibers on the calling
  OS thread, so ``__syncthreads`` (and ``_count``/``_and``/``_or``),
  ``__syncwarp``, the ``__shfl*_sync`` shuffles, the votes
  (``__all_sync``, ``__any_sync``, ``__ballot_sync``, ``__activemask``) and
  ``__shared__`` memory (static, and ``extern __shared__`` sized by the
  launch's ``shared_mem``) behave as on a GPU. A fiber runs until it waits at
  a barrier or a warp collective; the scheduler resumes the others round
  robin, and when none can run while some still wait (a thread returned
  before a barrier, a lane left out of a shuffle) the launch stops with an
  error naming the kernel and the waiting calls' source lines, never a hang;
  so do threads waiting at two different ``__syncthreads`` calls (undefined
  in CUDA) and masks or widths CUDA does not allow. Warps are 32 consecutive
  threads of the block's linear order (x fastest), as on a GPU.

``mode="auto"`` (the default) picks fibers exactly when the source names a
cooperative primitive, so sources whose kernels never cooperate keep the
sequential path (kernels_cu runs as fibers: the 8-bit kernels' lanes
shuffle). ``mode="sequential"`` on a cooperative
source runs each primitive as if its thread were alone in the block (what a
one-thread-at-a-time executor can offer): the executor's tests use it to show
that their kernels need cooperation.

Limits: one copy of each static ``__shared__`` variable per OS thread, kept
from block to block (a GPU leaves it undefined at block start; dynamic shared
memory is filled with 0xff bytes, NaN in every float type, at each block
start); ``__activemask`` gives the warp's lanes that have not returned (the
host cannot see a divergent branch); no atomics; no busy-waits on memory
another thread of the block writes (a fiber is never preempted); shuffled
values of 8 bytes at most; 256 KiB of stack per fiber.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .launch import kernel_argument_bytes
from .launch_config import is_probing
from .cuda_headers import cuda_include_dirs, missing_header_hint
from .sources import (VARIANTS, compile_options, kernel_files_source, kernel_names, variant_entries,
                        variant_of_kernel)

_COMPAT_HEADER = r"""
// Host-side stand-ins for the CUDA execution model (forced include).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __noinline__
#define __noinline__ __attribute__((noinline))
static thread_local uint3 threadIdx, blockIdx;
static thread_local dim3 blockDim, gridDim;
static constexpr int warpSize = 32;
#ifndef __align__
#define __align__(n) __attribute__((aligned(n)))
#endif
// One thread (or fiber) at a time on one OS thread: fences only stop g++ caching.
inline void __threadfence_block() { asm volatile("" ::: "memory"); }
inline void __threadfence() { asm volatile("" ::: "memory"); }

// Dynamic shared memory: every `extern __shared__ T name[];` becomes an alias
// of this buffer (host_exec.py rewrites it with an asm label).
extern "C" {  // (braces: a definition)
__attribute__((visibility("hidden"))) alignas(128) __thread unsigned char
    swiglu_host_dynamic_shared[SWIGLU_HOST_DYNAMIC_SHARED_BYTES];
}

namespace swiglu_host {
inline unsigned linear_thread() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
}  // namespace swiglu_host
"""

# Cooperative execution: block threads as fibers (mode "fibers").
_FIBER_RUNTIME = r"""
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__) || defined(SWIGLU_HOST_UCONTEXT)
#define SWIGLU_HOST_USE_UCONTEXT 1
#include <ucontext.h>
#else
// x86-64 context switch: ucontext's swapcontext makes a signal-mask system
// call per switch (~0.6 us); this saves the SysV callee-saved registers only.
asm(".text\n"
    ".p2align 4\n"
    ".type swiglu_fiber_switch, @function\n"
    "swiglu_fiber_switch:\n"        // (void** save_sp, void* load_sp)
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size swiglu_fiber_switch, .-swiglu_fiber_switch\n"
    ".type swiglu_fiber_entry, @function\n"
    "swiglu_fiber_entry:\n"         // first resume of a fiber: fn(arg) from r13(r12)
    "  movq %r12, %rdi\n"
    "  callq *%r13\n"
    "  ud2\n"
    ".size swiglu_fiber_entry, .-swiglu_fiber_entry\n");
extern "C" __attribute__((visibility("hidden"))) void swiglu_fiber_switch(void** save_sp, void* load_sp);
extern "C" __attribute__((visibility("hidden"))) void swiglu_fiber_entry();
#endif

namespace swiglu_host {

constexpr unsigned kWarp = 32;
constexpr unsigned kMaxBlockThreads = 1024;
constexpr std::size_t kStackBytes = 256 * 1024;

enum class Wait : unsigned char { Runnable, Barrier, Warp, Done, Fault };
enum class WarpKind : unsigned char { Sync, Shfl, ShflUp, ShflDown, ShflXor, All, Any, Ballot };

struct WarpCall {            // one lane's part in a warp collective
    WarpKind kind;
    const char* name;
    unsigned mask;
    long long arg;           // source lane, delta or lane mask
    int width;
    int line;                // of the call, in the kernel source
    unsigned long long value, result;
};

struct Executor;

struct Fiber {
#ifdef SWIGLU_HOST_USE_UCONTEXT
    ucontext_t context;
#else
    void* sp;
#endif
    char* stack;             // lowest usable byte; null until first run
    uint3 tid;
    unsigned linear;
    Wait wait;
    WarpCall call;
    Executor* ex;            // saves thread_local look-ups on the per-thread path
};

using AnyKernel = void (*)();
using Invoke = void (*)(AnyKernel, void**);

// Stacks are mmap'ed with a guard page below (an overflow faults instead of
// corrupting a neighbour) and reused across blocks and launches.
class StackPool {
  public:
    char* take() {
        if (!free_.empty()) {
            char* s = free_.back();
            free_.pop_back();
            return s;
        }
        const std::size_t page = sysconf(_SC_PAGESIZE);
        void* m = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return nullptr;
        mprotect(m, page, PROT_NONE);
        all_.push_back(static_cast<char*>(m));
        return static_cast<char*>(m) + page;
    }
    void give(char* s) { free_.push_back(s); }
    ~StackPool() {
        const std::size_t page = sysconf(_SC_PAGESIZE);
        for (char* m : all_) munmap(m, kStackBytes + page);
    }
  private:
    std::vector<char*> free_, all_;
};

// One per OS thread: a block's fibers all run on the thread that launched.
struct Executor {
    std::vector<Fiber> fibers = std::vector<Fiber>(kMaxBlockThreads);
    unsigned count = 0;                      // threads in the block
    Fiber* current = nullptr;
#ifdef SWIGLU_HOST_USE_UCONTEXT
    ucontext_t scheduler;
#else
    void* scheduler_sp = nullptr;
#endif
    unsigned done = 0, next_unstarted = 0;   // of the block's threads
    unsigned barrier_arrived = 0, barrier_true = 0;
    int barrier_result = 0, barrier_line = 0;  // line: of the open barrier's first arrival
    const Fiber* barrier_first = nullptr;
    bool faulted = false;
    std::string message;
    Invoke invoke = nullptr;
    AnyKernel kernel = nullptr;
    void** params = nullptr;
    StackPool stacks;
};

static thread_local Executor executor;

// The fiber gives control back to the scheduler; returns when resumed.
inline void park(Fiber& f) {
#ifdef SWIGLU_HOST_USE_UCONTEXT
    swapcontext(&f.context, &f.ex->scheduler);
#else
    swiglu_fiber_switch(&f.sp, f.ex->scheduler_sp);
#endif
    asm volatile("" ::: "memory");  // other fibers wrote shared memory meanwhile
}

inline void resume(Executor& ex, Fiber& f) {
    ex.current = &f;
    threadIdx = f.tid;
#ifdef SWIGLU_HOST_USE_UCONTEXT
    swapcontext(&ex.scheduler, &f.context);
#else
    swiglu_fiber_switch(&ex.scheduler_sp, f.sp);
#endif
    asm volatile("" ::: "memory");
}

// A stack runs its thread, then the block's next unstarted threads in turn
// without a switch (a block that never waits costs no more than a call per
// thread); it goes back to the scheduler when its thread waits or none is left.
[[noreturn]] inline void fiber_main(Fiber* f) {
    Executor& ex = *f->ex;
    for (;;) {
        ex.invoke(ex.kernel, ex.params);
        f->wait = Wait::Done;
        ++ex.done;
        if (ex.next_unstarted >= ex.count) break;
        Fiber* next = &ex.fibers[ex.next_unstarted++];
        next->stack = f->stack;
        f->stack = nullptr;
        f = next;
        ex.current = f;
        threadIdx = f->tid;
    }
    park(*f);
    __builtin_unreachable();  // a finished thread is never resumed
}

#ifdef SWIGLU_HOST_USE_UCONTEXT
inline void fiber_main_ucontext(unsigned lo, unsigned hi) {
    fiber_main(reinterpret_cast<Fiber*>((static_cast<std::uintptr_t>(hi) << 32) | lo));
}
#endif

inline void start(Fiber& f) {
#ifdef SWIGLU_HOST_USE_UCONTEXT
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    const std::uintptr_t p = reinterpret_cast<std::uintptr_t>(&f);
    makecontext(&f.context, reinterpret_cast<void (*)()>(fiber_main_ucontext), 2,
                static_cast<unsigned>(p), static_cast<unsigned>(p >> 32));
#else
    // The frame swiglu_fiber_switch pops: r15 r14 r13 r12 rbx rbp, then the
    // return address; after that ret the stack is 16-byte aligned, as at a call.
    void** sp = reinterpret_cast<void**>(f.stack + kStackBytes - 16);
    *--sp = reinterpret_cast<void*>(swiglu_fiber_entry);
    *--sp = nullptr;                                      // rbp
    *--sp = nullptr;                                      // rbx
    *--sp = &f;                                           // r12: the argument
    *--sp = reinterpret_cast<void*>(fiber_main);          // r13: the function
    *--sp = nullptr;                                      // r14
    *--sp = nullptr;                                      // r15
    f.sp = sp;
#endif
}

inline std::string thread_name(const Fiber& f) {
    char s[48];
    std::snprintf(s, sizeof s, "(%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z);
    return s;
}

// An error the kernel itself makes (a mask that leaves out its own lane, ...):
// the launch stops, and this fiber is never resumed.
[[noreturn]] inline void fault(const std::string& what) {
    Fiber& me = *executor.current;
    executor.faulted = true;
    executor.message = "thread " + thread_name(me) + " of block (" + std::to_string(blockIdx.x) + "," +
                       std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) + "): " + what;
    me.wait = Wait::Fault;
    park(me);
    __builtin_unreachable();
}

// __syncthreads and its reductions: every thread of the block must arrive,
// at the same call (CUDA leaves barriers in divergent code undefined).
inline int block_barrier(int predicate, int line) {
    Executor& ex = executor;
    Fiber& me = *ex.current;
    if (ex.barrier_arrived == 0) {
        ex.barrier_line = line;
        ex.barrier_first = &me;
    } else if (line != ex.barrier_line) {
        fault("__syncthreads on line " + std::to_string(line) + " while thread " + thread_name(*ex.barrier_first) +
              " waits at the one on line " + std::to_string(ex.barrier_line) + " (a barrier in divergent code)");
    }
    ex.barrier_true += predicate != 0;
    if (++ex.barrier_arrived < ex.count) {
        me.wait = Wait::Barrier;
        park(me);
        return ex.barrier_result;  // set by the last arrival; no later barrier can end without us
    }
    ex.barrier_result = static_cast<int>(ex.barrier_true);
    ex.barrier_arrived = ex.barrier_true = 0;
    for (unsigned i = 0; i < ex.count; ++i)
        if (ex.fibers[i].wait == Wait::Barrier) ex.fibers[i].wait = Wait::Runnable;
    asm volatile("" ::: "memory");
    return ex.barrier_result;
}

inline unsigned lanes_present(unsigned warp) {  // a block's last warp may be partial
    const unsigned n = executor.count - warp * kWarp;
    return n >= kWarp ? ~0u : (1u << n) - 1u;
}

inline unsigned long long warp_result(const Fiber* lanes, unsigned group, unsigned lane) {
    const WarpCall& c = lanes[lane].call;
    const long long first = lane & ~(c.width - 1), last = first + c.width - 1;
    long long src = lane;
    switch (c.kind) {
        case WarpKind::Sync: return 0;
        case WarpKind::All: case WarpKind::Any: case WarpKind::Ballot: {
            unsigned ballot = 0;
            for (unsigned j = 0; j < kWarp; ++j)
                if ((group >> j & 1u) && lanes[j].call.value) ballot |= 1u << j;
            if (c.kind == WarpKind::Ballot) return ballot;
            return c.kind == WarpKind::All ? ballot == group : ballot != 0;
        }
        case WarpKind::Shfl: src = first | (static_cast<unsigned long long>(c.arg) & (c.width - 1)); break;
        case WarpKind::ShflUp: src = lane - c.arg; break;
        case WarpKind::ShflDown: src = lane + c.arg; break;
        case WarpKind::ShflXor: src = lane ^ (c.arg & 31); break;  // may read an earlier segment, as on a GPU
    }
    if (src < (c.kind == WarpKind::ShflUp ? first : 0) || src > last) return c.value;  // outside: own value
    // A lane outside the collective: undefined on a GPU; the lane's own value here.
    if (!(group >> src & 1u)) return c.value;
    return lanes[src].call.value;
}

inline const char* hex_mask(char* s, unsigned mask) {
    std::snprintf(s, 16, "0x%08x", mask);
    return s;
}

// A warp collective: waits until every present lane named in mask has called
// the same intrinsic with the same mask, then the last arrival computes every
// lane's result at once (no slot is reused before all have read).
inline unsigned long long warp_collective(WarpKind kind, const char* name, unsigned mask, long long arg,
                                          int width, unsigned long long value, int line) {
    Executor& ex = executor;
    Fiber& me = *ex.current;
    const unsigned lane = me.linear % kWarp, warp = me.linear / kWarp;
    char a[16], b[16];
    if (!(mask >> lane & 1u))
        fault(std::string(name) + " on line " + std::to_string(line) + " with mask " + hex_mask(a, mask) +
              ", which leaves out the calling lane " +
              std::to_string(lane));
    if (width < 1 || width > static_cast<int>(kWarp) || (width & (width - 1)))
        fault(std::string(name) + " on line " + std::to_string(line) + " with width " + std::to_string(width) +
              ": not a power of two up to 32");
    me.call = WarpCall{kind, name, mask, arg, width, line, value, 0};
    me.wait = Wait::Warp;
    Fiber* lanes = &ex.fibers[warp * kWarp];
    const unsigned group = mask & lanes_present(warp);
    bool all_here = true;
    for (unsigned j = 0; j < kWarp; ++j) {
        if (!(group >> j & 1u)) continue;
        const Fiber& other = lanes[j];
        if (other.wait != Wait::Warp) { all_here = false; continue; }
        const WarpCall& oc = other.call;
        if ((oc.kind != kind || oc.mask != mask) && (oc.mask >> lane & 1u))  // each waits for the other
            fault(std::string(name) + " on line " + std::to_string(line) + " with mask " + hex_mask(a, mask) +
                  " in lane " + std::to_string(lane) + " while lane " + std::to_string(j) + " of warp " +
                  std::to_string(warp) + " waits at " + oc.name + " on line " + std::to_string(oc.line) +
                  " with mask " + hex_mask(b, oc.mask));
    }
    if (!all_here) {
        park(me);
        return me.call.result;
    }
    for (unsigned j = 0; j < kWarp; ++j)
        if (group >> j & 1u) lanes[j].call.result = warp_result(lanes, group, j);
    for (unsigned j = 0; j < kWarp; ++j)
        if (group >> j & 1u) lanes[j].wait = Wait::Runnable;
    return me.call.result;
}

inline unsigned active_lanes() {  // not exited: the host cannot tell a divergent branch
    const Fiber& me = *executor.current;
    const unsigned warp = me.linear / kWarp;
    unsigned mask = 0;
    for (unsigned j = 0; j < kWarp && warp * kWarp + j < executor.count; ++j) {
        const Wait w = executor.fibers[warp * kWarp + j].wait;
        if (w != Wait::Done && w != Wait::Fault) mask |= 1u << j;
    }
    return mask;
}

// Shuffled values travel as bytes (__half2 and friends have user-written
// copies, so "trivially copyable" would refuse types CUDA shuffles).
template <typename T>
inline unsigned long long to_bits(const T& v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_destructible<T>::value,
                  "host shuffles move plain values of up to 8 bytes");
    unsigned long long bits = 0;
    std::memcpy(&bits, static_cast<const void*>(&v), sizeof(T));
    return bits;
}

template <typename T>
inline T from_bits(unsigned long long bits, T v) {
    std::memcpy(static_cast<void*>(&v), &bits, sizeof(T));
    return v;
}

inline void describe_group(std::string& out, const char* what, const std::vector<const Fiber*>& group) {
    if (group.empty()) return;
    out += "; " + std::to_string(group.size()) + (group.size() == 1 ? " thread " : " threads ") + what + " (";
    for (std::size_t i = 0; i < group.size() && i < 4; ++i) out += (i ? ", " : "") + thread_name(*group[i]);
    out += group.size() > 4 ? ", ...)" : ")";
}

// No fiber can run but some have not finished: say who waits where.
inline std::string deadlock_message() {
    Executor& ex = executor;
    std::vector<const Fiber*> barrier, returned;
    std::vector<std::pair<std::string, std::vector<const Fiber*>>> warp_waits;
    for (unsigned i = 0; i < ex.count; ++i) {
        const Fiber& f = ex.fibers[i];
        if (f.wait == Wait::Barrier) barrier.push_back(&f);
        if (f.wait == Wait::Done) returned.push_back(&f);
        if (f.wait == Wait::Warp) {
            char m[16];
            std::string where = std::string("wait at ") + f.call.name + " on line " + std::to_string(f.call.line) +
                                " (mask " + hex_mask(m, f.call.mask) +
                                ", warp " + std::to_string(f.linear / kWarp) + ")";
            bool found = false;
            for (auto& w : warp_waits)
                if (w.first == where) { w.second.push_back(&f); found = true; }
            if (!found) warp_waits.push_back({where, {&f}});
        }
    }
    std::string out = "deadlock in block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," +
                      std::to_string(blockIdx.z) + ") of " + std::to_string(ex.count) + " threads";
    describe_group(out, ("wait at __syncthreads on line " + std::to_string(ex.barrier_line)).c_str(), barrier);
    for (auto& w : warp_waits) describe_group(out, w.first.c_str(), w.second);
    describe_group(out, "returned", returned);
    return out;
}

// Runs one block to the end; false (with ex.message) on a deadlock or fault.
// (ex is a parameter: g++ would redo the thread_local look-up after each switch.)
inline bool run_block(Executor& ex) {
    ex.done = ex.next_unstarted = 0;
    bool ok = true;
    while (ex.done < ex.count) {
        bool progressed = false;
        for (unsigned i = 0; i < ex.count && !ex.faulted; ++i) {
            Fiber& f = ex.fibers[i];
            if (f.wait != Wait::Runnable) continue;
            if (!f.stack) {  // unstarted: threads start in order, so i == ex.next_unstarted
                f.stack = ex.stacks.take();
                if (!f.stack) {
                    ex.faulted = true;
                    ex.message = "no memory for the fiber stack of thread " + thread_name(f);
                    break;
                }
                ex.next_unstarted = i + 1;
                start(f);
            }
            resume(ex, f);
            progressed = true;
            Fiber& last = *ex.current;  // the thread that gave control back (f or a later one)
            if (last.wait == Wait::Done) {
                ex.stacks.give(last.stack);
                last.stack = nullptr;
            }
        }
        if (ex.faulted) { ok = false; break; }
        if (!progressed) {
            ex.message = deadlock_message();
            ok = false;
            break;
        }
    }
    for (unsigned i = 0; i < ex.count; ++i) {  // the frames of abandoned fibers are dropped
        Fiber& f = ex.fibers[i];
        if (f.stack) { ex.stacks.give(f.stack); f.stack = nullptr; }
    }
    return ok;
}

inline int run_grid(Invoke invoke, AnyKernel kernel, const unsigned* g, const unsigned* b, void** params,
                    unsigned shared_bytes, char* err, unsigned errlen) {
    Executor& ex = executor;
    ex.invoke = invoke;
    ex.kernel = kernel;
    ex.params = params;
    ex.count = b[0] * b[1] * b[2];
    ex.faulted = false;
    for (unsigned t = 0; t < ex.count; ++t) {
        Fiber& f = ex.fibers[t];
        f.tid.x = t % b[0]; f.tid.y = t / b[0] % b[1]; f.tid.z = t / (b[0] * b[1]);
        f.linear = t;
        f.stack = nullptr;
        f.ex = &ex;
    }
    for (unsigned bz = 0; bz < g[2]; ++bz)
    for (unsigned by = 0; by < g[1]; ++by)
    for (unsigned bx = 0; bx < g[0]; ++bx) {
        blockIdx.x = bx; blockIdx.y = by; blockIdx.z = bz;
        std::memset(swiglu_host_dynamic_shared, 0xff, shared_bytes);
        for (unsigned t = 0; t < ex.count; ++t) ex.fibers[t].wait = Wait::Runnable;
        ex.barrier_arrived = ex.barrier_true = 0;
        if (!run_block(ex)) {
            std::snprintf(err, errlen, "%s", ex.message.c_str());
            ex.faulted = false;
            return 1;
        }
    }
    return 0;
}

}  // namespace swiglu_host

// Each takes its call's line (a default argument) for the error messages.
inline void __syncthreads(int line = __builtin_LINE()) { swiglu_host::block_barrier(0, line); }
inline int __syncthreads_count(int p, int line = __builtin_LINE()) { return swiglu_host::block_barrier(p, line); }
inline int __syncthreads_and(int p, int line = __builtin_LINE()) {
    return swiglu_host::block_barrier(p, line) == static_cast<int>(swiglu_host::executor.count);
}
inline int __syncthreads_or(int p, int line = __builtin_LINE()) { return swiglu_host::block_barrier(p, line) != 0; }
inline void __syncwarp(unsigned mask = 0xffffffffu, int line = __builtin_LINE()) {
    swiglu_host::warp_collective(swiglu_host::WarpKind::Sync, "__syncwarp", mask, 0, 32, 0, line);
}
template <typename T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize, int line = __builtin_LINE()) {
    return swiglu_host::from_bits<T>(swiglu_host::warp_collective(
        swiglu_host::WarpKind::Shfl, "__shfl_sync", mask, srcLane, width, swiglu_host::to_bits(var), line), var);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize, int line = __builtin_LINE()) {
    return swiglu_host::from_bits<T>(swiglu_host::warp_collective(
        swiglu_host::WarpKind::ShflUp, "__shfl_up_sync", mask, delta, width, swiglu_host::to_bits(var), line), var);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize, int line = __builtin_LINE()) {
    return swiglu_host::from_bits<T>(swiglu_host::warp_collective(
        swiglu_host::WarpKind::ShflDown, "__shfl_down_sync", mask, delta, width, swiglu_host::to_bits(var), line), var);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize, int line = __builtin_LINE()) {
    return swiglu_host::from_bits<T>(swiglu_host::warp_collective(
        swiglu_host::WarpKind::ShflXor, "__shfl_xor_sync", mask, laneMask, width, swiglu_host::to_bits(var), line), var);
}
inline int __all_sync(unsigned mask, int predicate, int line = __builtin_LINE()) {
    return static_cast<int>(swiglu_host::warp_collective(swiglu_host::WarpKind::All, "__all_sync", mask, 0, 32,
                                                         predicate != 0, line));
}
inline int __any_sync(unsigned mask, int predicate, int line = __builtin_LINE()) {
    return static_cast<int>(swiglu_host::warp_collective(swiglu_host::WarpKind::Any, "__any_sync", mask, 0, 32,
                                                         predicate != 0, line));
}
inline unsigned __ballot_sync(unsigned mask, int predicate, int line = __builtin_LINE()) {
    return static_cast<unsigned>(swiglu_host::warp_collective(swiglu_host::WarpKind::Ballot, "__ballot_sync",
                                                              mask, 0, 32, predicate != 0, line));
}
inline unsigned __activemask() { return swiglu_host::active_lanes(); }
#define __shared__ static thread_local
"""

# Mode "sequential" on a cooperative source: each primitive as if its thread
# were alone in the block (what one thread at a time can give).
_SEQUENTIAL_PRIMITIVES = r"""
inline void __syncthreads() {}
inline int __syncthreads_count(int p) { return p != 0; }
inline int __syncthreads_and(int p) { return p != 0; }
inline int __syncthreads_or(int p) { return p != 0; }
inline void __syncwarp(unsigned = 0xffffffffu) {}
template <typename T> inline T __shfl_sync(unsigned, T var, int, int = warpSize) { return var; }
template <typename T> inline T __shfl_up_sync(unsigned, T var, unsigned, int = warpSize) { return var; }
template <typename T> inline T __shfl_down_sync(unsigned, T var, unsigned, int = warpSize) { return var; }
template <typename T> inline T __shfl_xor_sync(unsigned, T var, int, int = warpSize) { return var; }
inline int __all_sync(unsigned, int p) { return p != 0; }
inline int __any_sync(unsigned, int p) { return p != 0; }
inline unsigned __ballot_sync(unsigned, int p) { return (p != 0 ? 1u : 0u) << swiglu_host::linear_thread() % 32; }
inline unsigned __activemask() { return 1u << swiglu_host::linear_thread() % 32; }
#define __shared__ static thread_local
"""

_LAUNCHER_TEMPLATE = r"""
template <typename... A, std::size_t... I>
static void swiglu_host_call(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<A*>(params[I])...);
}
template <typename... A>
static void swiglu_host_invoke(void (*kernel)(), void** params) {
    swiglu_host_call(reinterpret_cast<void (*)(A...)>(kernel), params, std::index_sequence_for<A...>{});
}
template <typename... A>
static int swiglu_host_launch(void (*kernel)(A...), const unsigned* g, const unsigned* b, void** params,
                              unsigned shared_bytes, char* err, unsigned errlen) {
    gridDim = dim3(g[0], g[1], g[2]);
    blockDim = dim3(b[0], b[1], b[2]);
#ifdef SWIGLU_HOST_FIBERS
    return swiglu_host::run_grid(&swiglu_host_invoke<A...>, reinterpret_cast<void (*)()>(kernel), g, b, params,
                                 shared_bytes, err, errlen);
#else
    for (unsigned bz = 0; bz < g[2]; ++bz)
    for (unsigned by = 0; by < g[1]; ++by)
    for (unsigned bx = 0; bx < g[0]; ++bx) {
        if (shared_bytes) std::memset(swiglu_host_dynamic_shared, 0xff, shared_bytes);
        for (unsigned tz = 0; tz < b[2]; ++tz)
        for (unsigned ty = 0; ty < b[1]; ++ty)
        for (unsigned tx = 0; tx < b[0]; ++tx) {
            blockIdx.x = bx; blockIdx.y = by; blockIdx.z = bz;
            threadIdx.x = tx; threadIdx.y = ty; threadIdx.z = tz;
            swiglu_host_call(kernel, params, std::index_sequence_for<A...>{});
        }
    }
    return 0;
#endif
}
"""

_WRAPPER_TEMPLATE = (
    'extern "C" int host_launch_{name}(const unsigned* g, const unsigned* b, void** p, unsigned shared_bytes, '
    "char* err, unsigned errlen) {{ return swiglu_host_launch({name}, g, b, p, shared_bytes, err, errlen); }}\n"
)

# A name that only cooperating threads need: mode "auto" runs fibers for it.
COOPERATIVE_PRIMITIVES = re.compile(
    r"\b(__syncthreads(?:_count|_and|_or)?|__syncwarp|__shfl(?:_up|_down|_xor)?_sync|__all_sync|__any_sync"
    r"|__ballot_sync|__activemask|__shared__)\b")
# extern __shared__ T name[];  ->  an alias of the launch's dynamic shared memory.
_EXTERN_SHARED = re.compile(r"\bextern\s+__shared__\s+([^;{}]*?)\s*\b(\w+)\s*\[\s*\]\s*;")
MODES = ("auto", "fibers", "sequential")
MAX_THREADS_PER_BLOCK = 1024  # CUDA's, whatever the GPU
MAX_DYNAMIC_SHARED_BYTES = 227 * 1024  # an sm_90 block's opt-in most (the host buffer's size)

# Optimization of the host build: -O1 builds every variant's kernels several
# times faster than -O2 and runs the test-sized launches about as fast; IEEE
# results do not depend on it (no fast-math, no FMA contraction on x86-64).
HOST_OPT_LEVEL = "-O1"


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("host execution needs a C++ compiler (g++); set $CXX")
    return cxx


def _cache_dir() -> Path:
    root = Path(os.environ.get("SWIGLU_CUPY_HOST_CACHE", Path(tempfile.gettempdir()) / "swiglu_cupy_host"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def execution_mode(source: str, mode: str = "auto") -> str:
    """The mode a build of ``source`` runs in: "fibers" or "sequential"
    ("auto": fibers exactly when the source names a cooperative primitive)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "fibers" if COOPERATIVE_PRIMITIVES.search(source) else "sequential"
    return mode


def _host_text(source: str, mode: str) -> tuple[str, str]:
    """(forced-include header, source) as g++ compiles them in ``mode``."""
    header = f"#define SWIGLU_HOST_DYNAMIC_SHARED_BYTES {MAX_DYNAMIC_SHARED_BYTES}\n{_COMPAT_HEADER}"
    if mode == "fibers":
        header += "#define SWIGLU_HOST_FIBERS 1\n" + _FIBER_RUNTIME
    elif COOPERATIVE_PRIMITIVES.search(source):
        header += _SEQUENTIAL_PRIMITIVES
    source = _EXTERN_SHARED.sub(r'extern __thread \1 \2[] __asm__("swiglu_host_dynamic_shared");', source)
    return header, source


class HostLibrary:
    """A CUDA source built as a host library; :meth:`launch` runs its kernels."""

    def __init__(self, path: Path, kernels: Sequence[str], mode: str) -> None:
        self.path = path
        self.kernels = tuple(kernels)
        self.mode = mode
        self._lib = ctypes.CDLL(str(path))
        self._entries: dict[str, object] = {}

    def _entry(self, kernel: str):
        fn = self._entries.get(kernel)
        if fn is None:
            if kernel not in self.kernels:
                raise ValueError(f"kernel {kernel!r} is not in this library ({', '.join(self.kernels)})")
            fn = getattr(self._lib, f"host_launch_{kernel}")
            fn.restype = ctypes.c_int
            self._entries[kernel] = fn
        return fn

    def launch(self, kernel: str, grid: Sequence[int], block: Sequence[int], args: Sequence[object],
               shared_mem: int = 0) -> None:
        """Run ``kernel`` over ``grid`` x ``block`` with ``args`` (numpy-typed
        scalars, ints (pointers: CuPy's 8 bytes), CPU tensors or numpy arrays, passed by address like
        cuLaunchKernel's kernelParams) and ``shared_mem`` bytes of dynamic
        shared memory. A deadlock or a misused primitive raises RuntimeError."""
        fn = self._entry(kernel)
        grid, block = _dims("grid", grid), _dims("block", block)
        threads = block[0] * block[1] * block[2]
        if threads > MAX_THREADS_PER_BLOCK:
            raise ValueError(f"kernel {kernel!r}: a block of {threads} threads exceeds CUDA's "
                             f"{MAX_THREADS_PER_BLOCK}")
        if not 0 <= shared_mem <= MAX_DYNAMIC_SHARED_BYTES:
            raise ValueError(f"kernel {kernel!r}: shared_mem={shared_mem} bytes is outside "
                             f"[0, {MAX_DYNAMIC_SHARED_BYTES}]")
        holders = [_kernel_argument(a) for a in args]  # each argument in its own C object
        params = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        err = ctypes.create_string_buffer(2048)
        rc = fn((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), params, ctypes.c_uint(shared_mem),
                err, ctypes.c_uint(len(err)))
        if rc:
            raise RuntimeError(f"host execution of kernel {kernel!r} failed: {err.value.decode(errors='replace')}")


def _dims(what: str, dims: Sequence[int]) -> tuple[int, int, int]:
    dims = tuple(int(d) for d in dims)
    if len(dims) != 3 or any(d < 0 for d in dims):
        raise ValueError(f"{what} must be three non-negative sizes, got {dims}")
    return dims


def _kernel_argument(a: object):
    if a.__class__ is int:  # a pointer: the 8 bytes CuPy passes for an int
        return ctypes.c_uint64(int.from_bytes(kernel_argument_bytes(a), "little"))
    if isinstance(a, np.uint64):
        return ctypes.c_uint64(int(a))
    if isinstance(a, np.int64):
        return ctypes.c_int64(int(a))
    if isinstance(a, np.uint32):
        return ctypes.c_uint32(int(a))
    if isinstance(a, np.int32):
        return ctypes.c_int32(int(a))
    if isinstance(a, np.float32):
        return ctypes.c_float(float(a))
    if isinstance(a, np.float64):
        return ctypes.c_double(float(a))
    if isinstance(a, torch.Tensor):
        if a.device.type != "cpu":
            raise ValueError(f"host kernels take CPU tensors, got one on {a.device}")
        return ctypes.c_uint64(a.data_ptr())
    if isinstance(a, np.ndarray):
        return ctypes.c_uint64(a.ctypes.data)
    raise TypeError(f"kernel arguments must be ints, numpy-typed scalars, tensors or arrays, got {type(a).__name__}")


_ANGLE_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<([^>]+)>", re.MULTILINE)


@functools.lru_cache(maxsize=64)
def included_headers_digest(names: tuple[str, ...], include_dirs: tuple[Path, ...]) -> str:
    """A digest of the headers under ``include_dirs`` that ``#include <name>``
    of ``names`` reads (g++ lists them, transitive ones included): each one's
    path relative to its dir and its contents. The same headers installed
    elsewhere give the same digest; an edited or updated header another.
    Read once per process (cached): a header edited while it runs is seen
    by the next process."""
    if not names:
        return ""
    probe = "".join(f"#include <{n}>\n" for n in sorted(set(names)))
    proc = subprocess.run([compiler(), "-x", "c++", "-std=c++17", "-M", *(f"-I{d}" for d in include_dirs), "-"],
                          input=probe, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"listing the CUDA headers for the host build failed:\n{proc.stderr}")
    roots = [Path(d).resolve() for d in include_dirs]
    found = set()
    for token in proc.stdout.replace("\\\n", " ").split()[1:]:  # after "-.o:"
        path = Path(token).resolve()
        for root in roots:
            if path.is_relative_to(root):
                found.add((str(path.relative_to(root)), path))
                break
    digest = hashlib.sha256()
    for relative, path in sorted(found):
        digest.update(relative.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_host_library(source: str, kernels: Sequence[str], *, options: Sequence[str] = (),
                       mode: str = "auto", label: str = "kernels") -> HostLibrary:
    """Build CUDA ``source`` as host C++ with launch entries for ``kernels``
    (names of its ``__global__`` functions) and load it. ``options`` are
    extra g++ flags (``-D...``); the library is cached by the hash of
    everything that goes into it."""
    mode = execution_mode(source, mode)
    includes = cuda_include_dirs()
    if not any((d / "cuda_fp16.h").is_file() for d in includes):
        raise RuntimeError(missing_header_hint("cuda_fp16.h"))
    header, text = _host_text(source, mode)
    text += "\n" + _LAUNCHER_TEMPLATE + "\n" + "".join(_WRAPPER_TEMPLATE.format(name=k) for k in kernels)
    flags = ["-x", "c++", "-std=c++17", HOST_OPT_LEVEL, "-fPIC", "-shared", "-w", *options]
    # Keyed by the CUDA headers' contents, not the include dirs' paths: a second venv holding
    # the same headers (CI's floor run) reuses the library instead of building it again.
    headers = included_headers_digest(tuple(_ANGLE_INCLUDE.findall(header + text)), tuple(includes))
    digest = hashlib.sha256("\0".join([header, text, compiler(), *flags, headers]).encode()).hexdigest()[:20]
    flags += [f"-I{d}" for d in includes]
    out = _cache_dir() / f"swiglu_{label}_{digest}.so"
    if not out.is_file():
        work = Path(tempfile.mkdtemp(prefix="swiglu_host_", dir=_cache_dir()))
        (work / "compat.h").write_text(header)
        (work / "kernel.cpp").write_text(text)
        tmp_out = work / out.name
        cmd = [compiler(), *flags, "-include", str(work / "compat.h"), str(work / "kernel.cpp"), "-o", str(tmp_out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"host build of the {label} failed:\n{' '.join(cmd)}\n{proc.stderr}")
        os.replace(tmp_out, out)  # atomic: concurrent builders never see half a file
        shutil.rmtree(work, ignore_errors=True)
    return HostLibrary(out, kernels, mode)


def host_source(dtype: torch.dtype) -> str:
    """The kernel files and every variant's entry points, as one source."""
    entries = "\n".join(variant_entries(v) for v in VARIANTS)
    return f"{kernel_files_source()}\n{entries}\n"


def build_library(dtype: torch.dtype) -> HostLibrary:
    """Compile every variant's kernels for one dtype into a host library."""
    names = [n for v in VARIANTS for n in kernel_names(v, dtype)]
    defines = [o for o in compile_options(dtype) if o.startswith("-D")]
    return build_host_library(host_source(dtype), names, options=defines, label=f"kernels_{str(dtype)[6:]}")


class HostLauncher:
    """Launcher that runs kernels on the CPU, on torch CPU tensors."""

    def __init__(self) -> None:
        self._libs: dict[torch.dtype, HostLibrary] = {}
        self._lock = threading.Lock()
        self.launches: list[tuple[str, tuple, tuple]] = []  # (name, grid, block), for tests
        self.probe_launches: list[tuple[str, tuple, tuple]] = []  # the same, of self-check probes

    def _library(self, dtype: torch.dtype) -> HostLibrary:
        lib = self._libs.get(dtype)
        if lib is None:
            built = build_library(dtype)  # outside the lock: builds may run in parallel
            with self._lock:
                lib = self._libs.setdefault(dtype, built)
        return lib

    def warm(self, dtypes: Sequence[torch.dtype]) -> None:
        """Build the libraries of ``dtypes`` now, one g++ per core."""
        with ThreadPoolExecutor(max_workers=max(1, min(len(dtypes), os.cpu_count() or 1))) as pool:
            list(pool.map(self._library, dtypes))

    def launch(self, name, dtype, device, grid, block, args, shared_mem=0):
        if torch.device(device).type != "cpu":
            raise ValueError(f"HostLauncher runs CPU tensors only, got device {device}")
        variant_of_kernel(name)  # a clear ValueError for an unknown name
        for a in args:  # what a GPU launch passes: ints (pointers) and numpy-typed scalars
            if a.__class__ is not int and not isinstance(a, (np.uint64, np.int64, np.float32, np.float64)):
                raise TypeError(f"kernel arguments must be ints or numpy-typed scalars, got {type(a).__name__}")
        lib = self._library(dtype)
        (self.probe_launches if is_probing() else self.launches).append((name, tuple(grid), tuple(block)))
        lib.launch(name, grid, block, args, shared_mem=shared_mem)
