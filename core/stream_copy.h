#pragma once

// Memory helpers whose fast forms are x86 intrinsics, with portable fallbacks elsewhere.

#include <cstddef>

namespace gradcomm {

// memcpy with non-temporal stores where the CPU has them (SSE2): for destinations too large to
// stay in cache, or that another core will read next, it saves reading each destination line
// before overwriting it. Not ordered by a later release store: call stream_fence() first.
// Elsewhere a plain memcpy.
void stream_copy(std::byte* dst, const std::byte* src, std::size_t bytes);

// Orders earlier non-temporal stores before later stores (sfence; nothing where stream_copy is a
// plain memcpy).
void stream_fence();

// One pause of a spin-wait loop (x86 pause: lets the sibling hyper-thread run, saves power).
void cpu_relax();

}  // namespace gradcomm
