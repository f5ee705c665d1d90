// Selection policy of "auto", from measurements on a 2-core machine with Open MPI 4.1 at 2 and 4
// ranks (README, "Measured"): recursive halving/doubling has the fewest steps (2 log2 n, or
// log2 n as whole-buffer recursive doubling up to 16 KiB) and wins up to a few MiB; the
// pipelined ring moves the same bytes in more, smaller steps and wins from 8 MiB on (at 2 MiB
// halving_doubling led by 1.27x vs 1.13x on 2 ranks and 1.10x vs 1.00x on 4; at 8 MiB ring led
// by 1.52x vs 1.38x and 1.25x vs 1.15x). A cost model calibrated per machine replaces this
// fixed threshold when topology-aware selection lands.

#include "collectives/auto_select.h"

#include <string>

namespace gradcomm::collectives {
namespace {

// The last choice, logged again only when it changes, so debug logs stay readable.
class AutoChoice : public Attachment {
 public:
  explicit AutoChoice(Communicator&) {}
  std::string_view last;
};

}  // namespace

std::string_view select_allreduce_algorithm(const AllreduceArgs& args, Communicator& comm) {
  const std::size_t bytes = args.count * args.element_bytes();
  constexpr std::size_t threshold = std::size_t{4} << 20;
  const std::string_view choice = bytes < threshold ? "halving_doubling" : "ring";
  AutoChoice& state = comm.attachment<AutoChoice>();
  if (state.last != choice && comm.log_enabled(LogLevel::debug)) {
    comm.log(LogLevel::debug, "auto: " + std::string(choice) + " for " + std::to_string(bytes) +
                                  " bytes on " + std::to_string(comm.size()) +
                                  " ranks (ring from " + std::to_string(threshold) + " bytes)");
  }
  state.last = choice;
  return choice;
}

}  // namespace gradcomm::collectives
