#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace gradcomm::trainer {

// Everything a run needs to continue exactly where it stopped.
struct CheckpointState {
  struct Tensor {
    std::string name;
    std::vector<std::uint64_t> shape;
    std::vector<float> values;
  };
  std::string model;  // Model::describe()
  std::vector<Tensor> parameters;
  std::string optimizer;  // Optimizer::name()
  std::uint64_t optimizer_steps = 0;
  std::vector<std::vector<float>> optimizer_state;
  std::uint64_t step = 0;  // trainer steps done; with the data fields, the data position
  std::uint64_t global_batch = 0;
  std::uint64_t data_rows = 0;
  std::uint64_t data_seed = 0;
  // Under auto: its decisions when the checkpoint was written (a tuning table's JSON; empty
  // otherwise). The writer adopted them from then on, and a resumed run adopts them too, so both
  // reduce with the same algorithms and end bit-identical. Version 2 on.
  std::string auto_decisions;
};

// The file format, version 2 (little-endian):
//   "GRADCKPT" | u32 version | u32 0 | u64 payload bytes | payload | u64 checksum
// The checksum is a 64-bit FNV-1a of everything before it. The payload is the fields of
// CheckpointState in order: strings and vectors as a u64 length then the elements. Version 1
// (read too) ends before auto_decisions.
inline constexpr std::uint32_t kCheckpointVersion = 2;

std::vector<std::byte> encode_checkpoint(const CheckpointState& state);
// Throws InvalidArgument naming `source` and the problem for anything but an intact version-1 or
// version-2 checkpoint: too short or truncated, not a checkpoint (magic), another version, a
// checksum mismatch (corrupted bytes), or a payload whose lengths run past its end.
CheckpointState decode_checkpoint(std::span<const std::byte> bytes, const std::string& source);

// Writes `bytes` to `path` so that a reader sees either the old file or the complete new one:
// write to a temporary file in the same directory, fsync, rename over `path`, fsync the
// directory. Creates the directory if missing. Throws Error naming the path on failure. After a
// successful write, removes temporary files of `path` left by writers on this host that died
// mid-write (their process no longer exists). Limits: a writer on a host that changed its name
// (a restarted container) leaves its file behind; containers that share a host name but not a
// PID namespace must not share a checkpoint directory.
void write_file_atomically(const std::string& path, std::span<const std::byte> bytes);
// The whole file; throws InvalidArgument naming the path when it cannot be read.
std::vector<std::byte> read_file(const std::string& path);

}  // namespace gradcomm::trainer
