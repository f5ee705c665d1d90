// Selection policy of "auto", from measurements on 2-core machines with Open MPI 4.1 (README,
// "Measured"): recursive halving/doubling has the fewest steps (2 log2 n) and wins on small and
// medium messages; the pipelined ring moves the fewest bytes and wins on large ones. The
// crossover grows with the rank count because the ring's step count grows linearly.

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
  const std::size_t crossover = std::size_t{256} << 10;  // per pair of ranks
  const std::size_t threshold = crossover * static_cast<std::size_t>(comm.size() / 2 + 1);
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
