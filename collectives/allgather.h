#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "core/communicator.h"
#include "core/data_type.h"

namespace gradcomm {

// Concatenates every rank's `send` (counts[r] elements on rank r) into `recv` in rank order, on
// every rank: recv receives sum(counts) elements. Collective: every rank passes the same counts
// (one per rank) and dtype. Throws InvalidArgument before any communication when counts has the
// wrong length, counts[rank] != send_count, a buffer is null with a non-zero count, or the
// gathered bytes exceed MPI's int displacements (2 GiB).
void allgatherv(Communicator& comm, const void* send, std::size_t send_count, void* recv,
                std::span<const std::size_t> counts, DataType dtype);

template <class T>
std::vector<T> allgatherv(Communicator& comm, std::span<const T> send,
                          std::span<const std::size_t> counts) {
  std::size_t total = 0;
  for (std::size_t c : counts)
    total += c;
  std::vector<T> out(total);
  allgatherv(comm, send.data(), send.size(), out.data(), counts, dtype_of<T>);
  return out;
}

}  // namespace gradcomm
