#include "collectives/check/consistency.h"

#include <mpi.h>

#include <sched.h>
#include <algorithm>
#include <exception>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "collectives/registry.h"
#include "core/error.h"
#include "core/progress_engine.h"
#include "core/shared_memory.h"
#include "topology/host.h"

namespace gradcomm::collectives {
namespace {

// The compared fields, each >= 0 (so that min(-x) gives the maximum in the same reduction).
constexpr int kFields = 10;
using Fields = std::array<std::int64_t, kFields>;
constexpr const char* kFieldNames[kFields] = {"sequence number",
                                              "kind of call",
                                              "count",
                                              "dtype",
                                              "op",
                                              "root",
                                              "algorithm",
                                              "tensor list or counts",
                                              "buffer location (GPU or host)",
                                              "element type"};
constexpr std::uint64_t kMask62 = (std::uint64_t{1} << 62) - 1;

Fields to_fields(const CallInfo& c) {
  return {static_cast<std::int64_t>(c.sequence & kMask62),
          static_cast<std::int64_t>(c.kind),
          static_cast<std::int64_t>(c.count & kMask62),
          c.dtype + 1,
          c.op + 1,
          c.root + 1,
          c.algorithm + 1,
          static_cast<std::int64_t>(c.detail & kMask62),
          c.device ? 1 : 0,
          c.element + 1};
}

CallInfo from_fields(const Fields& f) {
  CallInfo c;
  c.sequence = static_cast<std::uint64_t>(f[0]);
  c.kind = static_cast<CallKind>(f[1]);
  c.count = static_cast<std::uint64_t>(f[2]);
  c.dtype = static_cast<int>(f[3] - 1);
  c.op = static_cast<int>(f[4] - 1);
  c.root = static_cast<int>(f[5] - 1);
  c.algorithm = static_cast<int>(f[6] - 1);
  c.algorithm_name = algorithm_name_at(c.algorithm);
  c.detail = static_cast<std::uint64_t>(f[7]);
  c.device = f[8] != 0;
  c.element = static_cast<std::int16_t>(f[9] - 1);
  return c;
}

std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ULL;
  return h ^ (h >> 29);
}

// Tags are base + 256 * salt with salt in [1, salt_range()] (MPI guarantees tags up to 32767).
int salt_range() {
  static const int range = [] {
    int* ub = nullptr;
    int flag = 0;
    // MPI_TAG_UB is always set (MPI 4.0 section 9.1.1); should the query fail, MPI's guaranteed
    // minimum stands in.
    if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag) != MPI_SUCCESS) flag = 0;
    const int tag_ub = flag && ub ? *ub : 32767;
    return tag_ub / 256 - 2;
  }();
  return range;
}

// A 64-bit hash of a buffer's bytes, for full mode's output comparison.
std::uint64_t hash_bytes(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t a = 0x243f6a8885a308d3ULL, b = 0x13198a2e03707344ULL;
  std::size_t i = 0;
  for (; i + 16 <= bytes; i += 16) {
    std::uint64_t x, y;
    std::memcpy(&x, p + i, 8);
    std::memcpy(&y, p + i + 8, 8);
    a = (a ^ x) * 0x9e3779b97f4a7c15ULL;
    b = (b ^ y) * 0xc2b2ae3d27d4eb4fULL;
    a = (a << 31) | (a >> 33);
    b = (b << 29) | (b >> 35);
  }
  std::uint64_t tail = 0;
  std::memcpy(&tail, p + i, bytes - i);
  return mix(mix(a, b), tail ^ bytes);
}

// The comparison state of one communicator.
// One rank's fingerprint of one call on the board (a shared segment of single-host
// communicators): the fields, then `posted` = sequence + 1 with release.
struct alignas(64) BoardSlot {
  std::atomic<std::uint64_t> posted{0};
  std::int64_t fields[kFields];
};
// A rank can be at most one call ahead of another's posting (a call completes only once every
// rank has entered it: posted it, or for a call shm's packets proved, written its packet; a post
// its waits make comes before it marks the round reduced, which every peer waits for), so slots
// of 4 calls per rank never overwrite one still being read.
constexpr std::uint64_t kBoardDepth = 4;

}  // namespace

// The comparison state of one communicator. With GRADCOMM_CHECK=default on a communicator whose
// ranks share one host, fingerprints go through the board: each rank writes its own, reads the
// others' (no message at all); otherwise through MPI_Iallreduce.
class CheckState : public Attachment {
 public:
  explicit CheckState(Communicator& comm) : rank(comm.rank()), size(comm.size()) {
    if (comm.config().check != CheckMode::normal || size < 2 || !topology::shares_one_host(comm))
      return;
    try {
      board = SharedSegment(comm.mpi_comm(),
                            static_cast<std::size_t>(size) * kBoardDepth * sizeof(BoardSlot),
                            "consistency check board");
    } catch (const CommError&) {  // thrown on every rank alike: compare over MPI instead
    }
  }
  BoardSlot& slot(int r, std::uint64_t sequence) const {
    return reinterpret_cast<BoardSlot*>(
        board.data())[static_cast<std::size_t>(r) * kBoardDepth + sequence % kBoardDepth];
  }

  int rank, size;
  std::array<std::int64_t, 2 * kFields> send{}, recv{};
  MPI_Request request = MPI_REQUEST_NULL;
  Fields mine{};
  // Algorithms compared before their first use: a handful, scanned on every call (cheaper than a
  // tree's string comparisons on the 8-byte path).
  std::vector<std::string> used;
  bool renew = false;   // a mismatch ended a call: drop what cannot outlive it (every rank)
  SharedSegment board;  // empty: compare over MPI
  bool board_pending = false;
  std::uint64_t board_sequence = 0;
  std::vector<char> compared;  // peers whose board fingerprint was compared for board_sequence
  int uncompared = 0;
};

namespace {

void post(CheckState& state, const Fields& mine, Communicator& comm, std::string_view call) {
  state.mine = mine;
  for (int i = 0; i < kFields; ++i) {
    state.send[static_cast<std::size_t>(i)] = mine[static_cast<std::size_t>(i)];
    state.send[static_cast<std::size_t>(kFields + i)] = -mine[static_cast<std::size_t>(i)];
  }
  check_mpi(MPI_Iallreduce(state.send.data(), state.recv.data(), 2 * kFields, MPI_INT64_T, MPI_MIN,
                           comm.mpi_comm(), &state.request),
            std::string(call) + ": MPI_Iallreduce of the call fingerprint", comm.rank());
}

void board_post(CheckState& state, const Fields& mine, std::uint64_t sequence) {
  BoardSlot& slot = state.slot(state.rank, sequence);
  std::memcpy(slot.fields, mine.data(), sizeof slot.fields);
  slot.posted.store(sequence + 1, std::memory_order_release);
  state.mine = mine;
  state.board_sequence = sequence;
  state.board_pending = true;
  state.compared.assign(static_cast<std::size_t>(state.size), 0);
  state.compared[static_cast<std::size_t>(state.rank)] = 1;
  state.uncompared = state.size - 1;
}

[[noreturn]] void mismatch(const std::vector<CallInfo>& calls, CheckState& state,
                           Communicator& comm, const CallScope& scope, std::string_view call);

// Compares the fingerprints peers have posted for the current call; with `wait`, until all have.
// Every rank reads every slot, so every rank finds a difference and sees the same fingerprints.
void board_poll(CheckState& state, Communicator& comm, const CallScope& scope,
                std::string_view call, bool wait) {
  const std::uint64_t want = state.board_sequence + 1;
  long polls = 0;
  BackgroundPause pause;
  const bool background = on_progress_thread();
  while (state.board_pending) {
    for (int j = 0; j < state.size; ++j) {
      if (state.compared[static_cast<std::size_t>(j)]) continue;
      const BoardSlot& slot = state.slot(j, state.board_sequence);
      if (slot.posted.load(std::memory_order_acquire) < want) continue;
      if (std::memcmp(slot.fields, state.mine.data(), sizeof slot.fields) != 0) {
        // Wait for every rank's fingerprint (each posts before it communicates, or, deferred,
        // once its wait polls or its packets disagree), then report.
        std::vector<CallInfo> calls;
        for (int r = 0; r < state.size; ++r) {
          const BoardSlot& other = state.slot(r, state.board_sequence);
          for (long spins = 1; other.posted.load(std::memory_order_acquire) < want; ++spins) {
            sched_yield();
            if (spins % 16 == 0) drive_mpi_progress(comm.mpi_comm());
          }
          Fields f;
          std::memcpy(f.data(), other.fields, sizeof other.fields);
          calls.push_back(from_fields(f));
        }
        state.board_pending = false;
        mismatch(calls, state, comm, scope, call);
      }
      state.compared[static_cast<std::size_t>(j)] = 1;
      --state.uncompared;
    }
    if (state.uncompared == 0) state.board_pending = false;
    if (!wait || !state.board_pending) return;
    if (background) {
      pause.pause();  // the application computes meanwhile
      ++polls;
    } else if (++polls > 100) {
      sched_yield();
    }
    // A peer still in MPI (the previous call's ring) may need this rank's progress to post.
    if (background || polls % 16 == 0) drive_mpi_progress(comm.mpi_comm());
  }
}

// The comparison has completed: throws MismatchError on every rank when the fields differ.
void verify(CheckState& state, Communicator& comm, const CallScope& scope, std::string_view call) {
  bool agree = true;
  for (int i = 0; i < kFields; ++i) {
    agree = agree && state.recv[static_cast<std::size_t>(i)] ==
                         -state.recv[static_cast<std::size_t>(kFields + i)];
  }
  if (agree) return;
  // Every rank found the same minima and maxima, so every rank is here: gather the details.
  std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()) * kFields);
  check_mpi(MPI_Allgather(state.mine.data(), kFields, MPI_INT64_T, all.data(), kFields, MPI_INT64_T,
                          comm.mpi_comm()),
            std::string(call) + ": MPI_Allgather of the call fingerprints", comm.rank());
  std::vector<CallInfo> calls;
  for (int r = 0; r < comm.size(); ++r) {
    Fields f;
    std::memcpy(f.data(), all.data() + static_cast<std::size_t>(r) * kFields, sizeof f);
    calls.push_back(from_fields(f));
  }
  mismatch(calls, state, comm, scope, call);
}

// Every rank found the same difference: renews the communicator (collective), then reports.
void mismatch(const std::vector<CallInfo>& calls, CheckState& state, Communicator& comm,
              const CallScope& scope, std::string_view call) {
  comm.renew_after_mismatch();
  state.renew = true;  // done by the outermost scope, once no algorithm frame is on the stack
  const bool same_kind = std::all_of(calls.begin(), calls.end(), [&](const CallInfo& c) {
    return c.kind == calls[0].kind && c.sequence == calls[0].sequence;
  });
  if (same_kind && scope.detail_reporter()) scope.detail_reporter()();
  throw MismatchError(error_message(call, comm.rank(), describe_mismatch(calls)));
}

void complete(CheckState& state, Communicator& comm, const CallScope& scope,
              std::string_view call) {
  if (state.board_pending) return board_poll(state, comm, scope, call, /*wait=*/true);
  if (state.request == MPI_REQUEST_NULL) return;
  check_mpi(wait_all_mpi(1, &state.request),
            std::string(call) + ": MPI_Wait for the call fingerprint", comm.rank());
  verify(state, comm, scope, call);
}

// Full mode: every rank's output must hash the same.
void compare_outputs(const void* output, std::size_t bytes, Communicator& comm,
                     std::string_view call, std::uint64_t sequence) {
  const auto h = static_cast<std::int64_t>(hash_bytes(output, bytes) & kMask62);
  std::int64_t range[2] = {h, -h};
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_INT64_T, MPI_MIN, comm.mpi_comm()),
            std::string(call) + ": MPI_Allreduce of the output hash", comm.rank());
  if (range[0] == -range[1]) return;
  std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()));
  check_mpi(MPI_Allgather(&h, 1, MPI_INT64_T, all.data(), 1, MPI_INT64_T, comm.mpi_comm()),
            std::string(call) + ": MPI_Allgather of the output hashes", comm.rank());
  std::map<std::int64_t, std::vector<int>> by_hash;
  for (int r = 0; r < comm.size(); ++r)
    by_hash[all[static_cast<std::size_t>(r)]].push_back(r);
  std::string detail = "the ranks' outputs of call #" + std::to_string(sequence) +
                       " differ (GRADCOMM_CHECK=full compares them):";
  for (const auto& [value, ranks] : by_hash) {
    char text[24];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
    detail.append(" ranks");
    for (int r : ranks) {
      detail.push_back(' ');
      detail.append(std::to_string(r));
    }
    detail += std::string(" hash ") + text + ";";
  }
  detail.pop_back();
  throw MismatchError(error_message(call, comm.rank(), detail));
}

}  // namespace

std::string describe_mismatch(const std::vector<CallInfo>& calls) {
  // Group the ranks by what they called, the largest group first.
  std::vector<std::pair<Fields, std::vector<int>>> groups;
  for (std::size_t r = 0; r < calls.size(); ++r) {
    const Fields f = to_fields(calls[r]);
    auto it =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == f; });
    if (it == groups.end()) {
      groups.push_back({f, {}});
      it = groups.end() - 1;
    }
    it->second.push_back(static_cast<int>(r));
  }
  std::stable_sort(groups.begin(), groups.end(),
                   [](const auto& a, const auto& b) { return a.second.size() > b.second.size(); });
  std::string differing;
  for (int i = 0; i < kFields; ++i) {
    for (const auto& g : groups) {
      if (g.first[static_cast<std::size_t>(i)] != groups[0].first[static_cast<std::size_t>(i)]) {
        if (!differing.empty()) differing.append(", ");
        differing.append(kFieldNames[i]);
        break;
      }
    }
  }
  std::string failed;  // the ranks whose call failed before it could run (compare_failed_call)
  for (std::size_t r = 0; r < calls.size(); ++r) {
    if (calls[r].kind == CallKind::failed)
      failed.append(failed.empty() ? "" : ",") += std::to_string(r);
  }
  std::string text = "ranks disagree on the collective call (";
  if (!failed.empty()) {
    text = failed.find(',') == std::string::npos ? "the call failed on rank "
                                                 : "the call failed on ranks ";
    text.append(failed).append(" before it could run, so the ranks' calls differ (");
  }
  text.append(differing).append(" differ):");
  for (const auto& [fields, ranks] : groups) {
    text += ranks.size() == 1 ? " rank" : " ranks";
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      text.push_back(i ? ',' : ' ');
      text.append(std::to_string(ranks[i]));
    }
    text += " called " + describe(from_fields(fields)) + ";";
  }
  text.pop_back();
  return text;
}

namespace {
thread_local bool t_began = false;  // (KeepInStep)

// ifailed_call's work, submitted; its state (a caller that never waits for it drops it).
std::shared_ptr<detail::RequestState> queue_failed_call(Communicator& comm, CallKind attempted,
                                                        std::string call) {
  require_thread_multiple(call, comm.rank());
  auto state = std::make_shared<detail::RequestState>();
  state->call = std::move(call);
  state->work = [&comm, attempted, call = state->call] {
    try {
      compare_failed_call(comm, attempted, call);
    } catch (const MismatchError&) {  // the other ranks' error; the caller has its own
    }
  };
  comm.engine().submit(state);
  return state;
}
}  // namespace

KeepInStep::KeepInStep(Communicator& comm, CallKind kind, std::string_view call, bool queued)
    : comm_(comm),
      kind_(kind),
      call_(call),
      queued_(queued),
      exceptions_(std::uncaught_exceptions()),
      outer_(t_began) {
  t_began = false;
}

KeepInStep::~KeepInStep() {
  const bool stand_in = !t_began && std::uncaught_exceptions() > exceptions_;
  t_began = outer_ || t_began || stand_in;  // (outer front doors stand aside)
  if (!stand_in) return;
  // Alone, or unchecked, the stand-in waits for nobody; where MPI cannot take calls from the
  // engine's thread, nothing could have been queued (every rank's call fails alike there).
  if (queued_ && comm_.size() > 1 && comm_.config().check != CheckMode::off) {
    try {
      queue_failed_call(comm_, kind_, std::string(call_) + " (refused on this rank)");
      return;
    } catch (...) {  // (then here)
    }
  }
  try {
    compare_failed_call(comm_, kind_, call_);
  } catch (...) {  // nothing more can be done from an unwinding destructor
  }
}

void KeepInStep::began() {
  t_began = true;
}

Request ifailed_call(Communicator& comm, CallKind attempted, std::string call) {
  return Request(queue_failed_call(comm, attempted, std::move(call)));
}

void compare_failed_call(Communicator& comm, CallKind attempted, std::string_view call) {
  comm.settle();
  require_mpi_alive(call, comm.rank());
  CallInfo info;
  info.sequence = comm.next_sequence();
  info.kind = CallKind::failed;
  info.detail = static_cast<std::uint64_t>(attempted);
  CallScope scope(comm, info, call);
  scope.check_now();
  scope.finish();
}

CallScope::CallScope(Communicator& comm, const CallInfo& info, std::string_view call,
                     const CallContext* outer)
    : comm_(comm), info_(info), call_(call) {
  if (outer != nullptr) {  // part of an outer call
    context_ = *outer;
    return;
  }
  KeepInStep::began();
  annotate(info_);
  // The watchdog sees the call from here on: the comparison state below is built collectively
  // (the communicator's host count, the board of a single-host communicator) by every rank's
  // first call, which waits forever where ranks make their first calls on different
  // communicators.
  watchdog::Recorder* recorder = comm.recorder();
  if (recorder) recorder->begin(to_record(info_));
  try {
    state_ = &comm.attachment<CheckState>();
  } catch (...) {
    if (recorder) recorder->end(false);
    throw;
  }
  outermost_ = true;  // nothing below may throw
  std::uint64_t h = 0;
  for (std::int64_t f : to_fields(info_))
    h = mix(h, static_cast<std::uint64_t>(f));
  context_ = CallContext(this, &info_, 1 + static_cast<int>(h % salt_range()), h);
  // Nothing here may throw: full mode compares in start() or check_now(), before any
  // communication.
}

CallScope::~CallScope() {
  if (!outermost_) return;
  CheckState& state = *state_;
  if (!compared_ && !finished_ && comm_.size() > 1 && comm_.config().check != CheckMode::off) {
    // Unwinding from a failure on this rank before the call was compared (a set-up the other
    // ranks may not have failed: pinned staging, a GPU buffer under GRADCOMM_DETERMINISTIC):
    // they may be waiting in this call's comparison. It is compared as a failed call, so that
    // they fail too, naming this rank, and the ranks stay in step.
    info_.detail = static_cast<std::uint64_t>(info_.kind);
    info_.kind = CallKind::failed;
    try {
      post_fingerprint(state);
      compared_ = true;
      complete(state, comm_, *this, call_);
    } catch (...) {  // (MismatchError where the other ranks made the call: theirs to report)
    }
  }
  // Unwinding before a deferred post was made: a peer in another call may be polling for it.
  if (deferred_) post_deferred();
  if (state.request != MPI_REQUEST_NULL) {
    // Unwinding from another error: complete the comparison every rank posted, so that the
    // communicator's collectives stay in step (and its buffers outlive it).
    MPI_Wait(&state.request, MPI_STATUS_IGNORE);
  }
  state.board_pending = false;  // (the board needs no completion)
  if (state.renew) {
    comm_.drop_after_mismatch();
    state.renew = false;
    state.used.clear();  // the next shm call maps a new segment: compare before, as on first use
  }
  if (watchdog::Recorder* recorder = comm_.recorder()) recorder->end(finished_);
}

void CallScope::check_now() {
  if (!outermost_) return context_.require_check();
  if (comm_.config().check == CheckMode::off || comm_.size() == 1) return;
  CheckState& state = *state_;
  if (deferred_) post_deferred();
  if (!compared_) {
    post_fingerprint(state);
    compared_ = true;
  }
  complete(state, comm_, *this, call_);
}

void CallScope::post_fingerprint(CheckState& state) {
  if (state.board.data() != nullptr && comm_.config().check == CheckMode::normal) {
    board_post(state, to_fields(info_), info_.sequence);
  } else {
    post(state, to_fields(info_), comm_, call_);
  }
}

void CallScope::before_first_use(std::string_view what) {
  if (!outermost_ || comm_.size() == 1 || comm_.config().check == CheckMode::off) return;
  CheckState& state = *state_;
  if (std::find(state.used.begin(), state.used.end(), what) != state.used.end()) return;
  check_now();
  state.used.emplace_back(what);
}

void CallScope::start(std::string_view algorithm, bool polls_check, bool proves_call) {
  if (!outermost_ || comm_.size() == 1 || comm_.config().check == CheckMode::off) return;
  before_first_use(algorithm);
  if (comm_.config().check == CheckMode::full) return check_now();
  if (compared_) return;
  if (proves_call && state_->board.data() != nullptr) {
    proves_ = deferred_ = compared_ = true;
    return;
  }
  if (polls_check) {
    post_fingerprint(*state_);
    compared_ = true;  // polled by the waits, completed in finish()
    return;
  }
  check_now();
}

void CallScope::prove() {
  // Nothing is left to compare, nor any peer's post to wait for: where a long wait posted this
  // rank's fingerprint, the peers may have proven the call without posting theirs.
  deferred_ = false;
  state_->board_pending = false;
}

void CallScope::post_deferred() {
  deferred_ = false;
  post_fingerprint(*state_);
}

void CallScope::finish(const void* output, std::size_t bytes) {
  if (!outermost_) return;
  CheckState& state = *state_;
  if (deferred_) post_deferred();  // not proven (a peer outside any call): compare as usual
  complete(state, comm_, *this, call_);
  if (comm_.config().check == CheckMode::full && output != nullptr && comm_.size() > 1) {
    compare_outputs(output, bytes, comm_, call_, info_.sequence);
  }
  finished_ = true;
}

bool CallScope::pending() const {
  return outermost_ && (deferred_ || state_->board_pending || state_->request != MPI_REQUEST_NULL);
}

void CallScope::poll() {
  if (!outermost_) return;
  // A wait that polls is long enough for a peer in another call to be waiting for this post.
  if (deferred_) post_deferred();
  CheckState& state = *state_;
  if (state.board_pending) return board_poll(state, comm_, *this, call_, /*wait=*/false);
  if (state.request == MPI_REQUEST_NULL) return;
  int done = 0;
  check_mpi(MPI_Test(&state.request, &done, MPI_STATUS_IGNORE),
            std::string(call_) + ": MPI_Test of the call fingerprint", comm_.rank());
  if (done) verify(state, comm_, *this, call_);
}

bool CallContext::check_pending() const {
  return scope_ != nullptr && scope_->pending();
}

void CallContext::poll_check() const {
  if (scope_ != nullptr) scope_->poll();
}

void CallContext::require_check() const {
  if (scope_ != nullptr) scope_->check_now();
}

void CallContext::call_proven(const Communicator& comm) const {
  if (scope_ != nullptr && scope_->proves_ && &comm == &scope_->comm_) scope_->prove();
}

}  // namespace gradcomm::collectives
