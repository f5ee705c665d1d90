#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/config.h"
#include "core/progress_engine.h"
#include "core/shared_memory.h"
#include "core/watchdog.h"

namespace gradcomm {

// Initializes MPI (MPI_Init_thread, MPI_THREAD_MULTIPLE: non-blocking calls run on a progress
// thread) unless somebody already has. Safe to call more than once. argc/argv may be null.
void init(int* argc = nullptr, char*** argv = nullptr);
// Finalizes MPI if and only if init() initialized it. Safe to call more than once.
void finalize();
// True when MPI is initialized and not yet finalized.
bool mpi_ready();
// True when `comm` names a live communicator (neither MPI_COMM_NULL, a null handle, nor an
// unknown one: MPI_Comm_test_inter answers it with MPI's errors returned, not aborting), and
// then whether it is an intercommunicator in *inter, if given. MPI must be initialized.
bool is_communicator(MPI_Comm comm, int* inter = nullptr);
// Prints `message` on stderr and ends the job: MPI_Abort(MPI_COMM_WORLD, exit_code) while MPI
// runs, std::abort() after it. For failures with nobody left to throw to (GPU work that a caller
// has stopped waiting for, or that one rank's peers cannot see).
[[noreturn]] void abort_job(const std::string& message, int exit_code = 1);
// True once MPI_Finalize has begun, as seen by a Communicator created before (one atomic load:
// every collective checks it, so that a call after MPI_Finalize is an error, not an MPI abort).
bool mpi_finalized();
// Throws InvalidArgument naming `call` when MPI has been finalized: the first thing every public
// collective does, before it touches any per-communicator state (which may itself communicate).
void require_mpi_alive(std::string_view call, int rank);
// Throws Unsupported naming `call`, the thread level MPI runs at and what to do, unless MPI runs
// at MPI_THREAD_MULTIPLE (the first thing every non-blocking call checks: its progress thread
// calls MPI while the application's threads may too).
void require_thread_multiple(std::string_view call, int rank);

// Per-communicator state owned by a module above core (cached algorithm objects, sub-
// communicators, ...). Created on first use by Communicator::attachment<T>(), destroyed with the
// communicator, before its MPI_Comm is freed.
class Attachment {
 public:
  virtual ~Attachment() = default;
  // False for state that cannot outlive a call abandoned half-way when ranks disagreed (shared-
  // memory counters, sub-communicators with messages in flight): Communicator::
  // drop_after_mismatch destroys it, and the next use builds it afresh.
  virtual bool survives_mismatch() const { return true; }
};

// Lets MPI move transfers along. Open MPI progresses only inside MPI calls, and a rank that has
// finished its part of an exchange may still owe a peer the acknowledgement that completes the
// peer's send (a large message's receiver tells the sender it has pulled the data). So every
// wait outside MPI (shm's, the check board's, NCCL's) calls this now and then: otherwise a rank
// waiting there for a peer that waits in MPI for it never wakes either (a ring, then shm).
void drive_mpi_progress(MPI_Comm comm);

// A group of ranks gradcomm communicates over. Owns a duplicate of the MPI communicator it was
// built from, so gradcomm's messages never mix with the user's.
class Communicator {
 public:
  // Duplicates `comm` (collective over it). MPI must be initialized. Throws on a null comm.
  explicit Communicator(MPI_Comm comm, Config config = Config::from_environment());
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm mpi_comm() const { return comm_; }
  const Config& config() const { return config_; }

  // Sequence number of collective calls on this communicator: returns the current value and
  // advances it. Every rank advances it in the same order, so it can drive decisions that must
  // agree across ranks (the rotating root of `flat`).
  std::uint64_t next_sequence() { return sequence_++; }
  // The number the next call will get, without taking it.
  std::uint64_t peek_sequence() const { return sequence_; }

  // A reusable, 64-byte aligned scratch buffer of at least `bytes`. Slots are independent; a slot
  // only grows. The pointer stays valid until the next call for the same slot with more bytes.
  std::byte* scratch(std::size_t bytes, int slot = 0);

  // Registered memory (collective): `bytes` for this rank in a segment that every rank of this
  // communicator on the same host maps, so `shm` reads it in place (an all-reduce on it skips
  // the copy-in). Every rank must pass the same `bytes`: a mismatch throws InvalidArgument on
  // every rank, naming the sizes. bytes == 0 gives an empty handle. The memory is not zeroed
  // for reuse; a fresh one reads as zeros.
  RegisteredBuffer allocate(std::size_t bytes);

  template <class T>
  T& attachment() {
    static_assert(std::is_base_of_v<Attachment, T>, "attachments derive from Attachment");
    const std::size_t slot = attachment_slot<T>();
    if (slot < attachments_.size() && attachments_[slot]) {
      return static_cast<T&>(*attachments_[slot]);
    }
    return attach(std::make_unique<T>(*this));
  }

  // The attachment of type T, or null when none was made yet.
  template <class T>
  T* find_attachment() {
    const std::size_t slot = attachment_slot<T>();
    return slot < attachments_.size() ? static_cast<T*>(attachments_[slot].get()) : nullptr;
  }

  // Installs a prepared attachment (replacing any of the same type); for state a parent
  // communicator hands to a sub-communicator it created.
  template <class T>
  T& attach(std::unique_ptr<T> value) {
    static_assert(std::is_base_of_v<Attachment, T>, "attachments derive from Attachment");
    const std::size_t slot = attachment_slot<T>();
    if (slot >= attachments_.size()) attachments_.resize(slot + 1);
    T& result = *value;
    attachments_[slot] = std::move(value);
    return result;
  }

  // After ranks were found to disagree on a call (collective: every rank learns of it together):
  // replaces the MPI communicator by a fresh duplicate, so messages of the abandoned call that
  // are still posted can never match a later call's.
  void renew_after_mismatch();
  // Then, once no call is under way: destroys the attachments that do not survive a mismatch.
  void drop_after_mismatch();

  // The progress engine that runs this communicator's non-blocking calls; started on first use.
  ProgressEngine& engine();
  // Every call on this communicator that is not itself non-blocking begins here: it waits until
  // the requests submitted before have finished, so calls run in the order they were made and
  // never two at a time. One atomic load when nothing is in flight.
  void settle() {
    if (engine_ && engine_->busy()) engine_->drain();
  }

  // The flight recorder the stall watchdog reads (null for gradcomm's own sub-communicators and
  // when this rank's timeout is 0).
  watchdog::Recorder* recorder() const { return recorder_.get(); }

  bool log_enabled(LogLevel level) const { return level <= config_.log_level; }
  // Writes "[gradcomm rank R] level: message" to stderr when `level` is enabled.
  void log(LogLevel level, std::string_view message) const;

 private:
  // The endpoint exchange (collective); `wanted`: this rank keeps a recorder (its timeout > 0).
  void start_watchdog(bool wanted);
  // A small number per attachment type, the same for every communicator of the process.
  static std::size_t next_attachment_slot();
  template <class T>
  static std::size_t attachment_slot() {
    static const std::size_t slot = next_attachment_slot();
    return slot;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  Config config_;
  std::uint64_t sequence_ = 0;
  std::map<int, AlignedBuffer> scratch_;
  // Indexed by attachment_slot<T>(): an attachment is looked up on every call (several per call),
  // so in O(1), not by type name.
  std::vector<std::unique_ptr<Attachment>> attachments_;
  std::shared_ptr<watchdog::Recorder> recorder_;
  // Declared last, destroyed first: its requests use everything above.
  std::unique_ptr<ProgressEngine> engine_;
};

}  // namespace gradcomm
