#include "collectives/shm/store_choice.h"

#include <algorithm>
#include <bit>

namespace gradcomm::collectives {

ShmStores::ShmStores(const std::string& mode)
    : fixed_(mode == "cached"     ? 0
             : mode == "streamed" ? 1
                                  : -1) {}

std::size_t ShmStores::size_class(std::size_t bytes) {
  return static_cast<std::size_t>(std::bit_width(bytes));
}

bool ShmStores::next_call_streams(std::size_t bytes) {
  if (fixed_ >= 0) return fixed_ == 1;
  const std::size_t k = size_class(bytes);
  Class& c = classes_[k];
  if (c.counts[0] == 0 && c.counts[1] == 0) {
    // A new size starts from the nearest one measured both ways: the cost per byte of either way
    // moves little from 4 MiB up (0.18 and 0.25 ms per MiB at 4, 16 and 64 MiB here), the ratio
    // between them, which the machine's state sets, not at all.
    for (std::size_t d = 1; d < classes_.size(); ++d) {
      const Class* near = nullptr;
      if (k >= d && classes_[k - d].counts[0] >= 3 && classes_[k - d].counts[1] >= 3) {
        near = &classes_[k - d];
      } else if (k + d < classes_.size() && classes_[k + d].counts[0] >= 3 &&
                 classes_[k + d].counts[1] >= 3) {
        near = &classes_[k + d];
      }
      if (near) {
        c = *near;
        c.since_probe = 0;
        break;
      }
    }
  }
  // Three calls each way first, alternating (the first pays for the segment's fresh pages).
  if (c.counts[0] < 3 || c.counts[1] < 3) return c.counts[1] < c.counts[0];
  if (++c.since_probe >= c.probe_after) {
    c.since_probe = 0;
    return !c.streaming;
  }
  return c.streaming;
}

bool ShmStores::streaming(std::size_t bytes) const {
  return fixed_ >= 0 ? fixed_ == 1 : classes_[size_class(bytes)].streaming;
}

double ShmStores::cost(std::size_t bytes, bool streamed) const {
  return classes_[size_class(bytes)].cost(streamed);
}

double ShmStores::Class::cost(bool streamed) const {
  const long count = counts[streamed ? 1 : 0];
  const std::array<double, 3>& v = samples[streamed ? 1 : 0];
  if (count == 0) return 0;
  if (count == 1) return v[0];
  if (count == 2) return (v[0] + v[1]) / 2;
  return std::max(std::min(v[0], v[1]), std::min(std::max(v[0], v[1]), v[2]));
}

bool ShmStores::record(std::size_t bytes, bool streamed, double seconds) {
  if (fixed_ >= 0 || bytes == 0) return false;
  Class& c = classes_[size_class(bytes)];
  const int way = streamed ? 1 : 0;
  c.samples[way][static_cast<std::size_t>(c.counts[way]++ % 3)] =
      seconds / static_cast<double>(bytes);
  if (c.counts[0] < 3 || c.counts[1] < 3) return false;
  if (c.cost(!c.streaming) * kMargin < c.cost(c.streaming)) {
    c.streaming = !c.streaming;
    c.since_probe = 0;
    c.probe_after = kFirstProbe;
    return true;
  }
  if (streamed != c.streaming) {
    if (seconds / static_cast<double>(bytes) * kMargin < c.cost(c.streaming)) {
      c.since_probe = c.probe_after;  // promising, but one call: the next call confirms
    } else {
      c.probe_after = std::min(2 * c.probe_after, kLastProbe);
    }
  }
  return false;
}

}  // namespace gradcomm::collectives
