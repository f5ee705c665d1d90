#include "collectives/check/call_info.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "core/data_type.h"
#include "core/reduce_op.h"

namespace gradcomm::collectives {
namespace {

constexpr double kDeviceGraceSeconds = 5;

static_assert(std::is_trivially_copyable_v<CallInfo> &&
                  sizeof(CallInfo) <= watchdog::Record::kPayloadBytes,
              "a CallInfo travels in a watchdog record");

thread_local const CallAnnotation* t_annotation = nullptr;
std::atomic<std::string (*)(int)> g_element_namer{nullptr};

std::string describe_record(const watchdog::Record& record) {
  CallInfo call;
  std::memcpy(&call, record.payload.data(), sizeof call);
  return describe(call);
}

}  // namespace

std::string_view to_string(CallKind kind) {
  switch (kind) {
    case CallKind::allreduce:
      return "allreduce";
    case CallKind::broadcast:
      return "broadcast";
    case CallKind::allgatherv:
      return "allgatherv";
    case CallKind::grouped_allreduce:
      return "grouped_allreduce";
    case CallKind::gather:
      return "gather";
    case CallKind::allgather:
      return "allgather";
    case CallKind::scatter:
      return "scatter";
    case CallKind::alltoall:
      return "alltoall";
    case CallKind::barrier:
      return "barrier";
    case CallKind::reduce_scatter:
      return "reduce_scatter";
    case CallKind::reduce:
      return "reduce";
    case CallKind::allocate:
      return "allocate";
    case CallKind::failed:
      return "failed";
  }
  return "collective";
}

std::string describe(const CallInfo& call) {
  // Built with append: GCC 12's -Wrestrict misfires on chains of operator+ here.
  if (call.kind == CallKind::failed) {
    std::string text(to_string(static_cast<CallKind>(call.detail)));
    return text.append(" #")
        .append(std::to_string(call.sequence))
        .append(", which failed there before it could run");
  }
  std::string text(to_string(call.kind));
  text.append(" #").append(std::to_string(call.sequence));
  text.append(": ").append(std::to_string(call.count));
  if (call.kind == CallKind::broadcast || call.kind == CallKind::gather ||
      call.kind == CallKind::allgather || call.kind == CallKind::scatter) {
    text.append(" bytes");
    if (call.dtype >= 0) text.append(" of ").append(to_string(static_cast<DataType>(call.dtype)));
  } else if (call.dtype >= 0) {
    text.append(" x ").append(to_string(static_cast<DataType>(call.dtype)));
  } else {
    text.append(" elements");
  }
  if (call.op >= 0) text.append(" ").append(to_string(static_cast<ReduceOp>(call.op)));
  if (call.element >= 0) {
    std::string (*namer)(int) = g_element_namer.load(std::memory_order_acquire);
    text.append(" (")
        .append(namer ? namer(call.element) : "element type " + std::to_string(call.element))
        .append(")");
  }
  if (call.root >= 0) text.append(", root ").append(std::to_string(call.root));
  if (call.algorithm_name) text.append(", algorithm ").append(call.algorithm_name);
  if (call.kind == CallKind::grouped_allreduce || call.kind == CallKind::allgatherv) {
    char hash[24];
    std::snprintf(hash, sizeof hash, "%08llx",
                  static_cast<unsigned long long>(call.detail & 0xffffffffu));
    text.append(call.kind == CallKind::grouped_allreduce ? ", tensor list " : ", counts ");
    text.append(hash);
  } else if (call.detail != 0) {  // one of a coalesced list of calls (CallAnnotation)
    char hash[24];
    std::snprintf(hash, sizeof hash, "%08llx",
                  static_cast<unsigned long long>(call.detail & 0xffffffffu));
    text.append(", of list ").append(hash);
  }
  if (call.device) text.append(", GPU buffers");
  return text;
}

CallAnnotation::CallAnnotation(int element_type, int root_rank, CallKind as_kind,
                               std::uint64_t list_hash)
    : element(element_type), root(root_rank), as(as_kind), list(list_hash), outer_(t_annotation) {
  t_annotation = this;
}

CallAnnotation::~CallAnnotation() {
  t_annotation = outer_;
}

const CallAnnotation* CallAnnotation::current() {
  return t_annotation;
}

void annotate(CallInfo& call) {
  const CallAnnotation* a = t_annotation;
  if (a == nullptr || call.kind == CallKind::failed) return;
  call.element = static_cast<std::int16_t>(a->element);
  if (call.kind == CallKind::allreduce) {
    if (a->root >= 0) {
      call.kind = CallKind::reduce;
      call.root = a->root;
    } else {
      call.kind = a->as;
    }
  }
  if (a->list != 0) call.detail = (call.detail ^ a->list) * 0x100000001b3ULL;
}

void set_element_namer(std::string (*namer)(int element)) {
  g_element_namer.store(namer, std::memory_order_release);
}

watchdog::Record to_record(const CallInfo& call) {
  watchdog::Record record;
  record.sequence = call.sequence;
  record.grace_seconds = call.device ? kDeviceGraceSeconds : 0;
  record.describe = describe_record;
  std::memcpy(record.payload.data(), &call, sizeof call);
  return record;
}

}  // namespace gradcomm::collectives
