#include "packing/negotiator.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <limits>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

#include "collectives/allreduce.h"
#include "collectives/broadcast.h"
#include "collectives/exchange.h"
#include "collectives/reduce_scatter.h"
#include "core/error.h"
#include "core/gpu_runtime.h"
#include "core/half.h"
#include "core/progress_engine.h"
#include "packing/grouped_allreduce.h"

namespace gradcomm {
namespace {

// How long an application thread must have waited with nothing happening on its rank before the
// rank counts as stuck. When every rank is stuck and no operation can run, they fail together.
constexpr double kStuckSeconds = 1.0;
// A thread that tested a pending operation within this long counts as waiting for it in the
// watchdog's record: one that polls in a loop, sleeping between polls, is bounded by the timeout
// as one inside wait() is.
constexpr double kPolledSeconds = 2.0;
// Idle cycles: one a millisecond, then one every 5 ms after 100 quiet ones. A submission wakes
// its own rank at once; the other ranks take part at their next cycle. While an application
// thread waits for a negotiated call, its rank cycles (and polls an idle cycle) every 200 us, so
// that it sees a late rank's offer soon after it comes: the thread it would take cores from is
// blocked.
constexpr auto kIdleCycle = std::chrono::microseconds(1000);
constexpr auto kSleepyCycle = std::chrono::microseconds(5000);
constexpr auto kWaitedCycle = std::chrono::microseconds(BackgroundPause::kMaxPauseMicroseconds);
constexpr int kQuietBeforeSleepy = 100;

// The flags of a rank's cycle header (the low byte; the payload size is above it).
constexpr std::uint64_t kClosing = 1, kStuck = 2;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string_view kind_name(NegotiatedKind kind) {
  switch (kind) {
    case NegotiatedKind::allreduce:
      return "allreduce";
    case NegotiatedKind::broadcast:
      return "broadcast";
    case NegotiatedKind::allgather:
      return "allgather";
    case NegotiatedKind::alltoall:
      return "alltoall";
    case NegotiatedKind::barrier:
      return "barrier";
    case NegotiatedKind::join:
      return "join";
    case NegotiatedKind::reducescatter:
      return "reducescatter";
    case NegotiatedKind::failed:
      return "failed";
  }
  return "?";
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i == 8 && ranks.size() > 9) return text + ", ... (" + std::to_string(ranks.size()) + ")";
    text += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  return text;
}

// The cycle's wire format: little helpers over a byte vector.
class Writer {
 public:
  explicit Writer(std::vector<std::byte>& out) : out_(out) {}
  template <class T>
  void put(T value) {
    const auto at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &value, sizeof(T));
  }
  void put(const std::string& text) {
    put<std::uint32_t>(static_cast<std::uint32_t>(text.size()));
    const auto at = out_.size();
    out_.resize(at + text.size());
    std::memcpy(out_.data() + at, text.data(), text.size());
  }

 private:
  std::vector<std::byte>& out_;
};

class Reader {
 public:
  Reader(const std::byte* p, std::size_t n) : p_(p), end_(p + n) {}
  bool more() const { return p_ < end_; }
  template <class T>
  T get() {
    T value{};
    need(sizeof(T));
    std::memcpy(&value, p_, sizeof(T));
    p_ += sizeof(T);
    return value;
  }
  std::string text() {
    const auto n = get<std::uint32_t>();
    need(n);
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }

 private:
  void need(std::size_t n) const {
    if (static_cast<std::size_t>(end_ - p_) < n) {
      throw Error(ErrorCode::internal, "negotiation: a cycle message ends early");
    }
  }
  const std::byte* p_;
  const std::byte* end_;
};

// The watchdog's record of a wait for a name some ranks have not submitted.
struct WaitPayload {
  std::uint16_t missing_count;
  std::uint16_t missing[8];
  std::uint8_t kind;
  char name[45];
};
static_assert(sizeof(WaitPayload) <= watchdog::Record::kPayloadBytes);

std::string describe_wait(const watchdog::Record& record) {
  WaitPayload p;
  std::memcpy(&p, record.payload.data(), sizeof p);
  std::vector<int> missing(p.missing, p.missing + std::min<int>(p.missing_count, 8));
  std::string text = "negotiation of " + std::string(kind_name(NegotiatedKind{p.kind})) + " '" +
                     std::string(p.name, strnlen(p.name, sizeof p.name)) + "'";
  if (missing.empty()) return text;
  text +=
      ": not submitted by rank" + std::string(missing.size() > 1 ? "s " : " ") + rank_list(missing);
  if (p.missing_count > 8) text += ", ... (" + std::to_string(p.missing_count) + ")";
  return text;
}

// Fills `count` elements of `dtype` with the identity of `op` (a joined rank's contribution).
void fill_neutral(std::byte* p, std::size_t count, DataType dtype, ReduceOp op) {
  auto fill = [&](auto zero, auto one, auto lowest, auto highest) {
    using T = decltype(zero);
    const T v = op == ReduceOp::prod  ? one
                : op == ReduceOp::min ? highest
                : op == ReduceOp::max ? lowest
                                      : zero;
    std::fill_n(reinterpret_cast<T*>(p), count, v);
  };
  switch (dtype) {
    case DataType::float32:
      fill(0.0f, 1.0f, -std::numeric_limits<float>::infinity(),
           std::numeric_limits<float>::infinity());
      break;
    case DataType::float64:
      fill(0.0, 1.0, -std::numeric_limits<double>::infinity(),
           std::numeric_limits<double>::infinity());
      break;
    case DataType::float16:  // bits: 0, 1.0, -inf, +inf
      fill(std::uint16_t{0}, std::uint16_t{0x3C00}, std::uint16_t{0xFC00}, std::uint16_t{0x7C00});
      break;
    case DataType::bfloat16:
      fill(std::uint16_t{0}, std::uint16_t{0x3F80}, std::uint16_t{0xFF80}, std::uint16_t{0x7F80});
      break;
    case DataType::int32:
      fill(std::int32_t{0}, std::int32_t{1}, std::numeric_limits<std::int32_t>::min(),
           std::numeric_limits<std::int32_t>::max());
      break;
    case DataType::int64:
      fill(std::int64_t{0}, std::int64_t{1}, std::numeric_limits<std::int64_t>::min(),
           std::numeric_limits<std::int64_t>::max());
      break;
  }
}

// Horovod's ScaleBuffer: output[i] = factor * input[i], in the arithmetic negotiator.h states.
void scale(void* data, std::size_t count, DataType dtype, double factor) {
  if (factor == 1.0 || count == 0) return;
  const auto f = static_cast<float>(factor);
  auto integers = [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    constexpr double lo = static_cast<double>(std::numeric_limits<T>::min());
    constexpr double hi = static_cast<double>(std::numeric_limits<T>::max());
    for (std::size_t i = 0; i < count; ++i) {
      const double v = factor * static_cast<double>(p[i]);  // truncated toward zero below
      p[i] = v <= lo   ? std::numeric_limits<T>::min()
             : v >= hi ? std::numeric_limits<T>::max()
                       : static_cast<T>(v);
    }
  };
  switch (dtype) {
    case DataType::float32: {
      auto* p = static_cast<float*>(data);
      for (std::size_t i = 0; i < count; ++i)
        p[i] = f * p[i];
      break;
    }
    case DataType::float64: {
      auto* p = static_cast<double*>(data);
      for (std::size_t i = 0; i < count; ++i)
        p[i] = factor * p[i];
      break;
    }
    case DataType::float16: {
      auto* p = static_cast<std::uint16_t*>(data);
      for (std::size_t i = 0; i < count; ++i) {
        p[i] = float_to_half_bits(f * half_bits_to_float(p[i]));
      }
      break;
    }
    case DataType::bfloat16: {
      auto* p = static_cast<std::uint16_t*>(data);
      for (std::size_t i = 0; i < count; ++i) {
        p[i] = float_to_bfloat16_bits(f * bfloat16_bits_to_float(p[i]));
      }
      break;
    }
    case DataType::int32:
      integers(static_cast<std::int32_t*>(data));
      break;
    case DataType::int64:
      integers(static_cast<std::int64_t*>(data));
      break;
  }
}

}  // namespace

struct Negotiator::Offer {
  NegotiatedKind kind{};
  std::string signature;
  std::uint64_t count = 0;
  DataType dtype{};
  ReduceOp op{};
  int root = -1;
  bool sized_by_root = false;
  std::string algorithm;
  std::uint64_t fusion_threshold = 0;
  bool device = false;
  std::vector<std::uint64_t> splits;
  std::uint64_t cycle = 0;  // when it arrived
};

// The GPU all-reduces' stream and buffers (a fusion buffer, the stand-ins of a joined rank), on
// one device, made at the first such all-reduce on the negotiation thread, which keeps that device
// current from then on, and freed by that thread before it ends.
struct Negotiator::DeviceBuffers {
  DeviceBuffers(gpu::Runtime& r, int d) : runtime(r), device(d) {
    runtime.set_device(device);
    stream = runtime.stream_create();
  }
  // Bounded: a stream still busy after 10 s (a hung kernel) keeps its memory.
  ~DeviceBuffers() {
    try {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!runtime.stream_done(stream)) {
        if (std::chrono::steady_clock::now() > deadline) return;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      if (fused) runtime.device_free(fused);
      if (stand_in) runtime.device_free(stand_in);
      runtime.stream_destroy(stream);
    } catch (...) {  // nobody to report to at teardown
    }
  }
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;
  // Makes `buffer` hold at least `bytes`; called before a group's first collective, so that no
  // allocation (which may fail on this rank alone) comes between the group's collectives.
  void reserve(void*& buffer, std::size_t& size, std::size_t bytes) {
    if (bytes <= size) return;
    if (buffer) runtime.device_free(buffer);
    buffer = nullptr;
    size = 0;
    buffer = runtime.device_alloc(bytes);
    size = bytes;
  }

  gpu::Runtime& runtime;
  const int device;
  gpu::Stream stream = nullptr;
  void* fused = nullptr;
  std::size_t fused_bytes = 0;
  void* stand_in = nullptr;
  std::size_t stand_in_bytes = 0;
};

struct Negotiator::Entry {
  std::string name;
  std::uint64_t order = 0;  // first offer's arrival, the same number on every rank
  std::vector<std::optional<Offer>> offers;
  int submitted = 0;
  std::exception_ptr error;  // set when the offers disagree
};

const Negotiator::Offer& Negotiator::first_offer(const Entry& entry) {
  for (const auto& o : entry.offers) {
    if (o) return *o;
  }
  throw Error(ErrorCode::internal, "negotiation: '" + entry.name + "' has no offer");
}

Negotiator::Negotiator(Communicator& parent) : rank_(parent.rank()), size_(parent.size()) {
  parent.settle();
  data_ = std::make_unique<Communicator>(parent.mpi_comm(), parent.config());
  check_mpi(MPI_Comm_dup(parent.mpi_comm(), &control_), "negotiation: MPI_Comm_dup", rank_);
  last_progress_ = now_seconds();
  thread_ = std::thread([this] { loop(); });
}

Negotiator::~Negotiator() {
  close();
  if (control_ != MPI_COMM_NULL && !mpi_finalized()) MPI_Comm_free(&control_);
}

std::shared_ptr<NegotiatedState> Negotiator::submit(NegotiatedCall call) {
  auto state = std::make_shared<NegotiatedState>();
  const std::string name = call.name;
  if (call.kind == NegotiatedKind::alltoall &&
      call.splits.size() != static_cast<std::size_t>(size_)) {
    throw InvalidArgument(error_message(name, rank_,
                                        "alltoall needs one split per rank (" +
                                            std::to_string(call.splits.size()) + " for " +
                                            std::to_string(size_) + " ranks)"));
  }
  if (call.kind == NegotiatedKind::reducescatter) {
    std::uint64_t total = 0;
    for (std::uint64_t share : call.splits)
      total += share;
    if (call.splits.size() != static_cast<std::size_t>(size_) || total != call.count) {
      throw InvalidArgument(error_message(
          name, rank_,
          "reducescatter needs each of the " + std::to_string(size_) +
              " ranks' share, summing to the count (" + std::to_string(call.splits.size()) +
              " shares summing to " + std::to_string(total) + " for " + std::to_string(call.count) +
              " elements)"));
    }
  }
  if (call.device && (call.kind != NegotiatedKind::allreduce || call.prescale != 1.0 ||
                      call.postscale != 1.0 || call.gpu < 0)) {
    throw InvalidArgument(error_message(name, rank_,
                                        "GPU memory is negotiated for all-reduces only, unscaled "
                                        "(the caller scales on its stream), naming its device"));
  }
  // A GPU all-reduce's device, or the one a joining rank names: where it stands in.
  if (call.device || (call.kind == NegotiatedKind::join && call.gpu >= 0))
    last_gpu_.store(call.gpu);
  if (call.kind == NegotiatedKind::broadcast && (call.root < 0 || call.root >= size_)) {
    throw InvalidArgument(error_message(name, rank_,
                                        "root " + std::to_string(call.root) + " is outside the " +
                                            std::to_string(size_) + " ranks"));
  }
  state->call = std::move(call);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) {
      throw InvalidArgument(error_message(name, rank_, "the negotiator was shut down"));
    }
    if (!in_flight_.emplace(name, state).second) {
      throw InvalidArgument(error_message(
          name, rank_,
          "an operation of this name is already in flight on this rank (names must be unique "
          "until their operation has finished)"));
    }
    outbox_.push_back(state);
    last_progress_ = now_seconds();
  }
  wake_.notify_one();
  return state;
}

bool Negotiator::test(NegotiatedState& state) {
  if (!state.done.load(std::memory_order_acquire)) {
    state.polled_at.store(now_seconds(), std::memory_order_relaxed);
    return false;
  }
  if (state.error) std::rethrow_exception(state.error);
  return true;
}

void Negotiator::wait(NegotiatedState& state) {
  if (!state.done.load(std::memory_order_acquire)) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      last_progress_ = now_seconds();
    }
    waiters_.fetch_add(1, std::memory_order_acq_rel);
    int blocked = state.blocked.load(std::memory_order_acquire);
    while (blocked >= 0 && !state.blocked.compare_exchange_weak(blocked, blocked + 1)) {
    }
    if (blocked >= 0) blocked_.fetch_add(1, std::memory_order_acq_rel);  // finish() subtracts it
    while (!state.done.load(std::memory_order_acquire))
      state.done.wait(false);
    waiters_.fetch_sub(1, std::memory_order_acq_rel);
  }
  if (state.error) std::rethrow_exception(state.error);
}

void Negotiator::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closing_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Negotiator::finish(NegotiatedState& state, std::exception_ptr error) {
  state.error = std::move(error);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight_.erase(state.call.name);
    last_progress_ = now_seconds();
  }
  // Its waiters stop counting as blocked before they wake, so that this thread's next waits give
  // them the cores.
  const int blocked = state.blocked.exchange(-1, std::memory_order_acq_rel);
  if (blocked > 0) blocked_.fetch_sub(blocked, std::memory_order_acq_rel);
  state.done.store(true, std::memory_order_release);
  state.done.notify_all();
}

void Negotiator::loop() noexcept {
  pthread_setname_np(pthread_self(), "gradcomm-neg");
  ProgressThreadScope background;  // the cycles' waits give the cores back
  sleep_precisely();               // (with 50 us of slack each step of a cycle took 70-140 us)
  try {
    while (cycle()) {
    }
  } catch (...) {
    // A failed MPI call in a cycle: nothing can be negotiated any more.
    const std::exception_ptr error = std::current_exception();
    std::vector<std::shared_ptr<NegotiatedState>> pending;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closing_ = true;
      for (auto& [name, state] : in_flight_)
        pending.push_back(state);
    }
    for (auto& state : pending)
      finish(*state, error);
    table_.clear();
  }
  if (recording_ && data_->recorder()) data_->recorder()->end(false);
  device_.reset();  // on this thread, whose current device is the buffers'
  // Whatever is left (submitted after the last cycle) cannot run.
  std::vector<std::shared_ptr<NegotiatedState>> left;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [name, state] : in_flight_)
      left.push_back(state);
  }
  for (auto& state : left) {
    finish(*state, std::make_exception_ptr(InvalidArgument(error_message(
                       state->call.name, rank_, "the negotiator was shut down first"))));
  }
}

bool Negotiator::cycle() {
  // This rank's offers: what was submitted since the last cycle.
  std::vector<std::shared_ptr<NegotiatedState>> fresh;
  std::uint64_t flags = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fresh.assign(outbox_.begin(), outbox_.end());
    outbox_.clear();
    if (closing_) flags |= kClosing;
    const double now = now_seconds();
    polling_ = false;
    for (const auto& [name, state] : in_flight_) {
      if (now - state->polled_at.load(std::memory_order_relaxed) < kPolledSeconds) {
        polling_ = true;
        break;
      }
    }
    // Only a thread inside wait() makes its rank stuck: one that polls may be computing between
    // its polls, and submit later what another rank waits for. Polling counts for the watchdog
    // (note_wait), which ends a wait nothing ends after the timeout.
    if (waiters_.load(std::memory_order_acquire) > 0 && now - last_progress_ > kStuckSeconds) {
      flags |= kStuck;
    }
  }
  std::vector<std::byte>& mine = out_;  // the cycle's buffers keep their memory between cycles
  mine.clear();
  Writer w(mine);
  for (const auto& s : fresh) {
    const NegotiatedCall& c = s->call;
    w.put(c.name);
    w.put(static_cast<std::uint8_t>(c.kind));
    w.put(c.signature);
    w.put(static_cast<std::uint64_t>(c.count));
    w.put(static_cast<std::int32_t>(c.dtype));
    w.put(static_cast<std::int32_t>(c.op));
    w.put(static_cast<std::int32_t>(c.root));
    w.put(static_cast<std::uint8_t>(c.sized_by_root));
    w.put(c.algorithm);
    w.put(static_cast<std::uint64_t>(c.fusion_threshold));
    w.put(static_cast<std::uint8_t>(c.device));
    w.put(static_cast<std::uint32_t>(c.splits.size()));
    for (std::uint64_t v : c.splits)
      w.put(v);
  }
  if (mine.size() > static_cast<std::size_t>(INT_MAX)) {
    throw InvalidArgument(error_message("negotiation", rank_, "a cycle's offers exceed 2 GiB"));
  }

  // Every rank's header (payload size and flags), then, when any rank offers something, every
  // rank's offers.
  const auto n = static_cast<std::size_t>(size_);
  std::vector<std::uint64_t>& headers = headers_;
  headers.resize(n);
  std::uint64_t header = (static_cast<std::uint64_t>(mine.size()) << 8) | flags;
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(
      MPI_Iallgather(&header, 1, MPI_UINT64_T, headers.data(), 1, MPI_UINT64_T, control_, &request),
      "negotiation: MPI_Iallgather", rank_);
  // An idle cycle (nothing offered here, the last cycle quiet too) waits with sleeps up to an
  // idle interval: the others' headers come at their next cycle anyway. Across hosts its message
  // queues behind whatever the communicator's all-reduces have in flight, for up to a chunk's
  // time on the link, and polling that at 200 us cost the backend's DDP step 3-4% there
  // (docs/results/torch.md, "Two threads that polled too often"). A submission here ends those
  // sleeps: its offer goes in the next cycle, which waits for this one. The cycle's other waits
  // are as an application thread's own (MPI_Waitall) while one waits for a negotiated call: it is
  // blocked, so no computation wants the cores they would give back.
  if (fresh.empty() && flags == 0 && quiet_cycles_ > 0) wait_idle(request);
  ForegroundWhileWaited foreground(&blocked_);
  check_mpi(wait_all_mpi(1, &request), "negotiation: MPI_Iallgather", rank_);
  ++cycles_;
  std::vector<int>& sizes = sizes_;
  std::vector<int>& displs = displs_;
  sizes.resize(n);
  displs.resize(n);
  std::size_t total = 0;
  bool all_closing = true;
  std::vector<bool> stuck(n);
  for (std::size_t r = 0; r < n; ++r) {
    sizes[r] = static_cast<int>(headers[r] >> 8);
    if (total > static_cast<std::size_t>(INT_MAX) - static_cast<std::size_t>(sizes[r])) {
      throw InvalidArgument(error_message("negotiation", rank_, "a cycle's offers exceed 2 GiB"));
    }
    displs[r] = static_cast<int>(total);
    total += static_cast<std::size_t>(sizes[r]);
    all_closing = all_closing && (headers[r] & kClosing);
    stuck[r] = (headers[r] & (kClosing | kStuck)) != 0;
  }
  std::vector<std::byte>& offers = in_;
  offers.resize(total);
  if (total > 0) {
    check_mpi(MPI_Iallgatherv(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, offers.data(),
                              sizes.data(), displs.data(), MPI_BYTE, control_, &request),
              "negotiation: MPI_Iallgatherv", rank_);
    check_mpi(wait_all_mpi(1, &request), "negotiation: MPI_Iallgatherv", rank_);
  }

  // Into the table, in rank order: the same table on every rank.
  for (std::size_t r = 0; r < n; ++r) {
    Reader in(offers.data() + displs[r], static_cast<std::size_t>(sizes[r]));
    while (in.more()) {
      const std::string name = in.text();
      Offer o;
      o.kind = NegotiatedKind{in.get<std::uint8_t>()};
      o.signature = in.text();
      o.count = in.get<std::uint64_t>();
      o.dtype = DataType{in.get<std::int32_t>()};
      o.op = ReduceOp{in.get<std::int32_t>()};
      o.root = in.get<std::int32_t>();
      o.sized_by_root = in.get<std::uint8_t>() != 0;
      o.algorithm = in.text();
      o.fusion_threshold = in.get<std::uint64_t>();
      o.device = in.get<std::uint8_t>() != 0;
      o.splits.resize(in.get<std::uint32_t>());
      for (auto& v : o.splits)
        v = in.get<std::uint64_t>();
      o.cycle = cycles_;
      auto& slot = table_[name];
      if (!slot) {
        slot = std::make_unique<Entry>();
        slot->name = name;
        slot->order = offers_seen_++;
        slot->offers.resize(n);
      }
      slot->offers[r] = std::move(o);
      ++slot->submitted;
    }
  }

  // Joined ranks: those whose join is pending.
  const std::vector<bool> joined = joined_ranks();
  std::vector<Entry*> ready;
  for (auto& [name, entry] : table_) {
    const bool is_join = first_offer(*entry).kind == NegotiatedKind::join;
    bool complete = true;
    for (std::size_t r = 0; r < n && complete; ++r) {
      complete = entry->offers[r].has_value() || (joined[r] && !is_join);
    }
    if (complete) ready.push_back(entry.get());
  }
  std::sort(ready.begin(), ready.end(), [](const Entry* a, const Entry* b) {
    const bool ja = first_offer(*a).kind == NegotiatedKind::join;
    const bool jb = first_offer(*b).kind == NegotiatedKind::join;
    return ja != jb ? jb : a->order < b->order;  // join last
  });

  if (!ready.empty()) {
    if (recording_ && data_->recorder()) {
      data_->recorder()->end(true);
      recording_ = false;
    }
    run_ready(ready);
  } else if (total == 0 && !table_.empty() && [&] {
               for (std::size_t r = 0; r < n; ++r) {
                 if (!stuck[r] && !joined[r]) return false;
               }
               return true;
             }()) {
    // Every rank waits (or has joined, or shuts down) and nothing can run: it never will.
    std::string report =
        "negotiation: every rank is waiting and no operation can run, since no name was "
        "submitted by every rank:";
    for (auto& [name, entry] : table_)
      report += "\n  " + who_submitted(*entry);
    fail_everything(report);
  }
  note_wait(!ready.empty());

  if (all_closing && table_.empty() && total == 0) return false;

  // Pace the next cycle: at once while things happen, else at the idle interval, or sooner when
  // this rank submits.
  if (total > 0 || !ready.empty()) {
    quiet_cycles_ = 0;
    return true;
  }
  quiet_cycles_ = std::min(quiet_cycles_ + 1, kQuietBeforeSleepy);
  const auto interval = blocked_.load(std::memory_order_acquire) > 0 ? kWaitedCycle
                        : quiet_cycles_ >= kQuietBeforeSleepy        ? kSleepyCycle
                                                                     : kIdleCycle;
  std::unique_lock<std::mutex> lock(mutex_);
  wake_.wait_for(lock, interval,
                 [&] { return !outbox_.empty() || (closing_ && !(flags & kClosing)); });
  return true;
}

void Negotiator::wait_idle(MPI_Request& request) {
  // Sparse polls: the cycle completes at the last rank's next one, up to an idle interval away,
  // and a submission here wakes this thread anyway.
  const auto cap = [&] {
    return blocked_.load(std::memory_order_acquire) > 0 ? kWaitedCycle : kIdleCycle;
  };
  std::chrono::microseconds sleep = cap() / 4;
  std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
  for (;;) {
    int done = 0;
    check_mpi(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "negotiation: MPI_Iallgather", rank_);
    if (done) return;
    lock.lock();
    const bool woken = wake_.wait_for(lock, sleep, [&] { return !outbox_.empty() || closing_; });
    lock.unlock();
    if (woken) return;  // the caller waits at the working pace
    sleep = std::min(sleep * 2, std::chrono::duration_cast<std::chrono::microseconds>(cap()));
  }
}

std::vector<bool> Negotiator::joined_ranks() const {
  std::vector<bool> joined(static_cast<std::size_t>(size_), false);
  for (const auto& [name, entry] : table_) {
    if (first_offer(*entry).kind != NegotiatedKind::join) continue;
    for (std::size_t r = 0; r < joined.size(); ++r)
      joined[r] = entry->offers[r].has_value();
  }
  return joined;
}

std::string Negotiator::who_submitted(const Entry& entry) const {
  std::vector<int> by, not_by;
  std::string signature;
  for (int r = 0; r < size_; ++r) {
    const auto& o = entry.offers[static_cast<std::size_t>(r)];
    (o ? by : not_by).push_back(r);
    if (o && signature.empty()) signature = o->signature;
  }
  return "'" + entry.name + "' (" + signature + "): submitted by rank" +
         (by.size() > 1 ? "s " : " ") + rank_list(by) +
         (not_by.empty()
              ? ""
              : ", not by rank" + std::string(not_by.size() > 1 ? "s " : " ") + rank_list(not_by));
}

void Negotiator::fail_everything(const std::string& why) {
  for (auto& [name, entry] : table_) {
    if (!entry->offers[static_cast<std::size_t>(rank_)]) continue;
    std::shared_ptr<NegotiatedState> mine;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (auto it = in_flight_.find(name); it != in_flight_.end()) mine = it->second;
    }
    if (mine) finish(*mine, std::make_exception_ptr(MismatchError(why)));
  }
  table_.clear();
}

void Negotiator::run_ready(std::vector<Entry*>& ready) {
  // Signatures first: one name must mean one operation on every rank that submitted it.
  for (Entry* e : ready) {
    for (int r = 0; r < size_ && !e->error; ++r) {  // a call that failed on a rank before it ran
      const auto& o = e->offers[static_cast<std::size_t>(r)];
      if (o && o->kind == NegotiatedKind::failed) {
        e->error = std::make_exception_ptr(
            MismatchError("'" + e->name + "': the call failed on rank " + std::to_string(r) +
                          " before it could run there (" + o->signature + ")"));
      }
    }
    const Offer* first = nullptr;
    int first_rank = -1;
    for (int r = 0; r < size_ && !e->error; ++r) {
      const auto& o = e->offers[static_cast<std::size_t>(r)];
      if (!o) continue;
      if (!first) {
        first = &*o;
        first_rank = r;
        continue;
      }
      const bool same_count = o->count == first->count || o->kind == NegotiatedKind::allgather ||
                              o->kind == NegotiatedKind::alltoall || o->sized_by_root;
      if (o->kind != first->kind || o->signature != first->signature || !same_count ||
          o->root != first->root || o->sized_by_root != first->sized_by_root ||
          o->device != first->device) {
        auto where = [](const Offer& offer) {
          return offer.signature + (offer.device ? " (GPU memory)" : "");
        };
        e->error = std::make_exception_ptr(
            MismatchError("'" + e->name + "': rank " + std::to_string(first_rank) + " submitted " +
                          where(*first) + ", rank " + std::to_string(r) + " " + where(*o) +
                          "; ranks must agree on what one name means"));
      }
    }
    if (e->error || !first) continue;
    std::vector<int> standing_in;
    for (int r = 0; r < size_; ++r) {
      if (!e->offers[static_cast<std::size_t>(r)]) standing_in.push_back(r);
    }
    if (standing_in.empty()) continue;
    const std::string who = "rank" + std::string(standing_in.size() > 1 ? "s " : " ") +
                            rank_list(standing_in) + " joined";
    if (first->kind == NegotiatedKind::alltoall) {
      e->error =
          std::make_exception_ptr(MismatchError("'" + e->name + "': " + who +
                                                "; alltoall cannot run while ranks have "
                                                "joined (only allreduce, allgather, reducescatter, "
                                                "broadcast and barrier can)"));
    } else if (first->kind == NegotiatedKind::broadcast &&
               !e->offers[static_cast<std::size_t>(first->root)]) {
      e->error = std::make_exception_ptr(MismatchError(
          "'" + e->name + "': the root, rank " + std::to_string(first->root) + ", has joined"));
    }
  }

  // In order, all-reduces of one dtype and op fused at the place of the first of them.
  std::vector<bool> taken(ready.size(), false);
  for (std::size_t i = 0; i < ready.size(); ++i) {
    if (taken[i]) continue;
    Entry& e = *ready[i];
    const Offer* first = &first_offer(e);
    if (!e.error && first->kind == NegotiatedKind::allreduce) {
      std::vector<Entry*> group;
      for (std::size_t j = i; j < ready.size(); ++j) {
        if (taken[j] || ready[j]->error) continue;
        const Offer* f = &first_offer(*ready[j]);
        if (f->kind == NegotiatedKind::allreduce && f->dtype == first->dtype &&
            f->op == first->op && f->algorithm == first->algorithm &&
            f->fusion_threshold == first->fusion_threshold && f->device == first->device) {
          group.push_back(ready[j]);
          taken[j] = true;
        }
      }
      if (first->device) {
        run_device_allreduces(group);
      } else {
        run_allreduces(group);
      }
      continue;
    }
    taken[i] = true;
    std::shared_ptr<NegotiatedState> mine;
    if (e.offers[static_cast<std::size_t>(rank_)]) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (auto it = in_flight_.find(e.name); it != in_flight_.end()) mine = it->second;
    }
    if (e.error) {
      if (mine) finish(*mine, e.error);
    } else {
      run_one(e, mine.get());
    }
  }
  for (Entry* e : ready)
    table_.erase(e->name);
}

void Negotiator::run_allreduces(const std::vector<Entry*>& group) {
  std::vector<packing::TensorDesc> tensors;
  std::vector<std::shared_ptr<NegotiatedState>> states;
  std::size_t stand_in_bytes = 0;
  const Offer* first = nullptr;
  for (Entry* e : group) {
    const auto& mine = e->offers[static_cast<std::size_t>(rank_)];
    if (!mine) {
      const Offer& o = first_offer(*e);
      stand_in_bytes += o.count * element_size(o.dtype);
    }
  }
  if (scratch_.size() < stand_in_bytes) scratch_.resize(stand_in_bytes);
  std::size_t at = 0;
  for (Entry* e : group) {
    const auto& mine = e->offers[static_cast<std::size_t>(rank_)];
    if (mine) {
      std::shared_ptr<NegotiatedState> state;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        state = in_flight_.at(e->name);
      }
      tensors.push_back({state->call.data, state->call.count, state->call.dtype});
      states.push_back(std::move(state));
      first = &*mine;
    } else {
      const Offer* o = &first_offer(*e);
      first = o;
      fill_neutral(scratch_.data() + at, o->count, o->dtype, o->op);
      tensors.push_back({scratch_.data() + at, o->count, o->dtype});
      at += o->count * element_size(o->dtype);
    }
  }
  std::exception_ptr error;
  try {
    ForegroundWhileWaited foreground(&blocked_);
    for (auto& s : states)
      scale(s->call.data, s->call.count, s->call.dtype, s->call.prescale);
    GroupedAllreduceOptions options;
    options.algorithm = first->algorithm;
    if (first->fusion_threshold) options.fusion_threshold = first->fusion_threshold;
    grouped_allreduce(*data_, tensors, first->op, options);
    for (auto& s : states)
      scale(s->call.data, s->call.count, s->call.dtype, s->call.postscale);
  } catch (...) {
    error = std::current_exception();
  }
  for (auto& s : states)
    finish(*s, error);
}

// Ends the job: a GPU all-reduce failed on this rank in a way its peers cannot see (they are in,
// or past, the group's collectives), or its work never finished on the GPU, which may still write
// into the callers' tensors.
[[noreturn]] void abort_gpu_group(int rank, const std::string& why) {
  abort_job(error_message("negotiation (GPU all-reduce)", rank, why + ": aborting the job"));
}

// GPU all-reduces that became ready together, on the negotiator's stream: after each tensor's
// ready event (a wait on the GPU, not the host), in buckets of at most the fusion threshold (a
// larger tensor alone, in place), each bucket copied into a fusion buffer, reduced through
// gradcomm's GPU path and copied back. A joined rank stands in with the op's neutral values in
// device memory. Done once the stream has passed the last copy back. The buffers are reserved
// before the first collective; what fails on this rank alone after that ends the job.
void Negotiator::run_device_allreduces(const std::vector<Entry*>& group) {
  struct Item {
    std::shared_ptr<NegotiatedState> state;  // null: this rank stands in
    std::size_t count, bytes;
  };
  const Offer& agreed = first_offer(*group.front());  // the same on every rank
  const std::size_t es = element_size(agreed.dtype);
  std::vector<Item> items;
  int device = -1;
  for (Entry* e : group) {
    const auto& mine = e->offers[static_cast<std::size_t>(rank_)];
    std::shared_ptr<NegotiatedState> state;
    if (mine) {
      std::lock_guard<std::mutex> lock(mutex_);
      state = in_flight_.at(e->name);
      if (device < 0) device = state->call.gpu;
    }
    const std::size_t count = mine ? mine->count : first_offer(*e).count;
    items.push_back({std::move(state), count, count * es});
  }
  // Standing in for every tensor: the device of this rank's GPU all-reduces so far.
  if (device < 0) device = device_ ? device_->device : last_gpu_.load();
  std::exception_ptr error;
  std::size_t issued = 0, planned = 0;  // the group's collectives enqueued so far, and in all
  const char* call = "negotiation (GPU all-reduce)";
  try {
    ForegroundWhileWaited foreground(&blocked_);
    std::string why;
    gpu::Runtime* runtime = gpu::runtime(&why);
    if (!runtime) throw Unsupported(error_message(call, rank_, "the GPU path cannot run: " + why));
    if (device < 0) {
      throw InvalidArgument(error_message(call, rank_,
                                          "this rank stands in for a GPU all-reduce before it "
                                          "has made one: no device to run it on"));
    }
    if (!device_ || device_->device != device) {
      device_.reset();
      device_ = std::make_unique<DeviceBuffers>(*runtime, device);
    }
    DeviceBuffers& d = *device_;
    // Buckets, and the memory they need, before any collective.
    const std::size_t threshold =
        agreed.fusion_threshold ? agreed.fusion_threshold : data_->config().fusion_threshold;
    std::vector<std::pair<std::size_t, std::size_t>> buckets;  // [first, last) items
    std::size_t fused_bytes = 0, stand_in_bytes = 0;
    for (std::size_t i = 0; i < items.size();) {
      std::size_t j = i, bytes = 0;
      while (j < items.size() && (j == i || bytes + items[j].bytes <= threshold)) {
        bytes += items[j].bytes;
        ++j;
      }
      if (j > i + 1) fused_bytes = std::max(fused_bytes, bytes);
      buckets.emplace_back(i, j);
      i = j;
    }
    planned = buckets.size();
    for (const Item& item : items)
      if (!item.state) stand_in_bytes += item.bytes;
    try {
      d.reserve(d.fused, d.fused_bytes, fused_bytes);
      d.reserve(d.stand_in, d.stand_in_bytes, stand_in_bytes);
    } catch (const std::exception& e) {
      abort_gpu_group(rank_, std::string("its buffers could not be allocated: ") + e.what());
    }
    for (const Item& item : items) {  // the work that writes each tensor, on the GPU
      if (item.state && item.state->call.ready_event)
        runtime->stream_wait_event(d.stream, item.state->call.ready_event);
    }
    std::vector<std::byte*> source(items.size(), nullptr);
    if (stand_in_bytes > 0) {  // neutral values, filled on the host and copied once
      if (scratch_.size() < stand_in_bytes) scratch_.resize(stand_in_bytes);
      auto* on_device = static_cast<std::byte*>(d.stand_in);
      std::size_t at = 0;
      for (std::size_t i = 0; i < items.size(); ++i) {
        if (items[i].state) continue;
        fill_neutral(scratch_.data() + at, items[i].count, agreed.dtype, agreed.op);
        source[i] = on_device + at;
        at += items[i].bytes;
      }
      runtime->copy_async(on_device, scratch_.data(), stand_in_bytes, d.stream);
      runtime->stream_synchronize(d.stream);  // scratch_ is reused by the next group
    }
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (items[i].state) source[i] = static_cast<std::byte*>(items[i].state->call.data);
    }
    AllreduceOptions options;
    options.algorithm = agreed.algorithm;
    options.stream = d.stream;
    options.asynchronous = true;
    auto* fused = static_cast<std::byte*>(d.fused);
    for (const auto& [i, j] : buckets) {
      if (j == i + 1) {  // alone: reduced where it lies
        allreduce(*data_, source[i], source[i], items[i].count, agreed.dtype, agreed.op, options);
      } else {
        std::size_t at = 0;
        for (std::size_t k = i; k < j; ++k) {
          runtime->copy_async(fused + at, source[k], items[k].bytes, d.stream);
          at += items[k].bytes;
        }
        allreduce(*data_, fused, fused, at / es, agreed.dtype, agreed.op, options);
        at = 0;
        for (std::size_t k = i; k < j; ++k) {
          if (items[k].state) runtime->copy_async(source[k], fused + at, items[k].bytes, d.stream);
          at += items[k].bytes;
        }
      }
      ++issued;
    }
    // The result must be in the tensors before their states are done: past GRADCOMM_TIMEOUT the
    // kernels may still write there, so nothing can be handed back.
    const int timeout = data_->config().timeout_seconds;
    const auto start = std::chrono::steady_clock::now();
    for (int polls = 0; !runtime->stream_done(d.stream); ++polls) {
      if (timeout > 0 && std::chrono::steady_clock::now() - start > std::chrono::seconds(timeout)) {
        abort_gpu_group(rank_, "its work did not finish on the GPU within " +
                                   data_->config().timeout_text() + " (a peer may have stopped)");
      }
      if (polls < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  } catch (...) {
    // Before the first collective, or one every rank refused alike (its checks run before
    // communication): an error for the callers. Between collectives, the peers are already in
    // the next one: that this rank skips it would leave them waiting.
    const bool standing_in_only =
        std::none_of(items.begin(), items.end(), [](const Item& item) { return item.state; });
    if ((issued > 0 && issued < planned) || (standing_in_only && issued < planned)) {
      // Between collectives; or this rank stands in for every tensor, so no caller here sees
      // the error while the peers wait in the collectives it cannot join.
      try {
        throw;
      } catch (const std::exception& e) {
        abort_gpu_group(rank_,
                        std::string(standing_in_only ? "it cannot stand in for a joined rank: "
                                                     : "a collective failed on this rank: ") +
                            e.what());
      }
    }
    error = std::current_exception();
  }
  for (Item& item : items) {
    if (item.state) finish(*item.state, error);
  }
}

void Negotiator::run_one(Entry& e, NegotiatedState* mine) {
  const Offer* first = &first_offer(e);
  const auto n = static_cast<std::size_t>(size_);
  std::exception_ptr error;
  std::vector<std::byte> result;
  std::vector<std::uint64_t> counts;
  int last_joined = -1;
  try {
    ForegroundWhileWaited foreground(&blocked_);
    switch (first->kind) {
      case NegotiatedKind::allreduce:
        break;  // run_allreduces
      case NegotiatedKind::failed:
        break;  // failed in run_ready
      case NegotiatedKind::barrier:
        barrier(*data_);
        break;
      case NegotiatedKind::broadcast: {
        const Offer& root = *e.offers[static_cast<std::size_t>(first->root)];
        const auto bytes = static_cast<std::size_t>(root.count);
        void* buffer = nullptr;
        if (rank_ == first->root) {
          buffer = mine->call.data;
        } else if (first->sized_by_root || !mine) {
          result.resize(bytes);
          buffer = result.data();
        } else {
          buffer = mine->call.data;
        }
        broadcast_bytes(*data_, buffer, bytes, first->root);
        if (!mine || !first->sized_by_root) result.clear();
        break;
      }
      case NegotiatedKind::allgather: {
        counts.resize(n);
        std::uint64_t sum = 0;
        for (std::size_t r = 0; r < n; ++r) {
          counts[r] = e.offers[r] ? e.offers[r]->count : 0;
          sum += counts[r];
        }
        result.resize(sum);
        std::vector<std::size_t> sizes(counts.begin(), counts.end());
        allgatherv_bytes(*data_, mine ? mine->call.data : nullptr, result.data(), sizes);
        break;
      }
      case NegotiatedKind::alltoall: {
        counts.resize(n);
        std::uint64_t sum = 0;
        for (std::size_t r = 0; r < n; ++r) {
          counts[r] = e.offers[r]->splits[static_cast<std::size_t>(rank_)];
          sum += counts[r];
        }
        result.resize(sum);
        const auto& splits = mine->call.splits;
        std::vector<std::size_t> send(splits.begin(), splits.end());
        std::vector<std::size_t> recv(counts.begin(), counts.end());
        alltoallv_bytes(*data_, mine->call.data, send, result.data(), recv);
        break;
      }
      case NegotiatedKind::reducescatter: {
        const DataType dtype = first->dtype;
        const std::size_t bytes = element_size(dtype);
        const auto& shares = first->splits;  // the same on every rank (the shape decides them)
        std::size_t before = 0;
        for (int r = 0; r < rank_; ++r)
          before += shares[static_cast<std::size_t>(r)];
        const std::size_t share = shares[static_cast<std::size_t>(rank_)];
        // The input: the caller's (never written), a prescaled copy of it, or a joined rank's
        // neutral values.
        const void* input = mine ? mine->call.data : nullptr;
        if (!mine || mine->call.prescale != 1.0) {
          if (scratch_.size() < first->count * bytes) scratch_.resize(first->count * bytes);
          if (mine) {
            if (first->count > 0) std::memcpy(scratch_.data(), input, first->count * bytes);
            scale(scratch_.data(), first->count, dtype, mine->call.prescale);
          } else {
            fill_neutral(scratch_.data(), first->count, dtype, first->op);
          }
          input = scratch_.data();
        }
        result.resize(share * bytes);
        if (std::all_of(shares.begin(), shares.end(), [&](auto s) { return s == shares[0]; })) {
          reduce_scatter(*data_, input, result.data(), share, dtype, first->op);
        } else {  // the whole reduction, of which this rank keeps its share
          if (whole_.size() < first->count * bytes) whole_.resize(first->count * bytes);
          allreduce(*data_, input, whole_.data(), first->count, dtype, first->op);
          if (share > 0) std::memcpy(result.data(), whole_.data() + before * bytes, share * bytes);
        }
        if (mine) scale(result.data(), share, dtype, mine->call.postscale);
        counts.assign(shares.begin(), shares.end());
        if (!mine) result.clear();
        break;
      }
      case NegotiatedKind::join: {
        std::uint64_t latest = 0;
        for (std::size_t r = 0; r < n; ++r) {
          if (e.offers[r]->cycle >= latest) {
            latest = e.offers[r]->cycle;
            last_joined = static_cast<int>(r);
          }
        }
        break;
      }
    }
  } catch (...) {
    error = std::current_exception();
  }
  if (mine) {
    mine->result = std::move(result);
    mine->counts = std::move(counts);
    mine->last_joined = last_joined;
    finish(*mine, error);
  }
}

void Negotiator::note_wait(bool ran) {
  watchdog::Recorder* recorder = data_->recorder();
  if (!recorder) return;
  const bool waiting = waiters_.load(std::memory_order_acquire) > 0 || polling_;
  // The oldest name this rank submitted that is still in the table.
  const Entry* oldest = nullptr;
  if (waiting) {
    for (const auto& [name, entry] : table_) {
      if (entry->offers[static_cast<std::size_t>(rank_)] &&
          (!oldest || entry->order < oldest->order)) {
        oldest = entry.get();
      }
    }
  }
  if (!oldest) {
    if (recording_) recorder->end(true);
    recording_ = false;
    return;
  }
  WaitPayload p{};
  std::vector<int> missing;
  for (int r = 0; r < size_; ++r) {
    if (!oldest->offers[static_cast<std::size_t>(r)]) missing.push_back(r);
  }
  p.missing_count = static_cast<std::uint16_t>(std::min<std::size_t>(missing.size(), 65535));
  for (std::size_t i = 0; i < missing.size() && i < 8; ++i) {
    p.missing[i] = static_cast<std::uint16_t>(missing[i]);
  }
  p.kind = static_cast<std::uint8_t>(oldest->offers[static_cast<std::size_t>(rank_)]->kind);
  std::strncpy(p.name, oldest->name.c_str(), sizeof p.name - 1);
  watchdog::Record record;
  record.sequence = data_->peek_sequence();
  record.describe = &describe_wait;
  std::memcpy(record.payload.data(), &p, sizeof p);
  if (recording_ && !ran) {
    recorder->update(record);
  } else {
    if (recording_) recorder->end(true);
    recorder->begin(record);
    recording_ = true;
  }
}

}  // namespace gradcomm
