#pragma once

// One pause of a spin-wait loop: the x86 pause instruction (lets the sibling hyper-thread run,
// saves power), nothing elsewhere.

namespace gradcomm {

void cpu_relax();

}  // namespace gradcomm
