#include "trainer/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string_view>

#include "core/error.h"

namespace gradcomm::trainer {
namespace {

constexpr char kMagic[8] = {'G', 'R', 'A', 'D', 'C', 'K', 'P', 'T'};
constexpr std::size_t kHeaderBytes = 8 + 4 + 4 + 8;

std::uint64_t fnv1a(const std::byte* p, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i)
    h = (h ^ static_cast<std::uint64_t>(p[i])) * 1099511628211ull;
  return h;
}

class Writer {
 public:
  void raw(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  void u32(std::uint32_t v) { raw(&v, sizeof v); }
  void u64(std::uint64_t v) { raw(&v, sizeof v); }
  void str(const std::string& s) {
    u64(s.size());
    raw(s.data(), s.size());
  }
  void floats(const std::vector<float>& v) {
    u64(v.size());
    raw(v.data(), v.size() * sizeof(float));
  }
  std::vector<std::byte>& bytes() { return out_; }

 private:
  std::vector<std::byte> out_;
};

class Reader {
 public:
  Reader(std::span<const std::byte> bytes, const std::string& source)
      : bytes_(bytes), source_(source) {}

  void raw(void* p, std::size_t n) {
    if (n > bytes_.size() - pos_) fail("the payload ends early (truncated or corrupt)");
    if (n == 0) return;  // p may be null (an empty vector's data())
    std::memcpy(p, bytes_.data() + pos_, n);
    pos_ += n;
  }
  std::uint64_t u64() {
    std::uint64_t v = 0;
    raw(&v, sizeof v);
    return v;
  }
  // A length of `element` -sized items that must fit in what is left.
  std::uint64_t length(std::size_t element) {
    const std::uint64_t n = u64();
    if (n > (bytes_.size() - pos_) / element)
      fail("a length runs past the end (truncated or corrupt)");
    return n;
  }
  std::string str() {
    std::string s(length(1), '\0');
    raw(s.data(), s.size());
    return s;
  }
  std::vector<float> floats() {
    std::vector<float> v(length(sizeof(float)));
    raw(v.data(), v.size() * sizeof(float));
    return v;
  }
  bool done() const { return pos_ == bytes_.size(); }
  [[noreturn]] void fail(const std::string& detail) const {
    throw InvalidArgument(error_message("load checkpoint " + source_, -1, detail));
  }

 private:
  std::span<const std::byte> bytes_;
  const std::string& source_;
  std::size_t pos_ = 0;
};

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

// Temporary files of earlier writers of `target` on this host whose process no longer exists
// (killed mid-write): "<name>.tmp.<host>.<pid>". Files of other hosts (a shared directory) and
// of live processes are left alone.
void remove_stale_temporaries(const std::filesystem::path& dir, const std::string& name,
                              const std::string& host) {
  std::string prefix = name;
  prefix.append(".tmp.").append(host).push_back('.');
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const auto& entry = *it;
    const std::string file = entry.path().filename().string();
    if (file.size() <= prefix.size() || file.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = file.substr(prefix.size());
    if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const auto pid = static_cast<pid_t>(std::stol(digits));
    if (pid == ::getpid() || pid <= 0) continue;
    if (::kill(pid, 0) == -1 && errno == ESRCH) {
      std::error_code ignored;
      std::filesystem::remove(entry.path(), ignored);
    }
  }
}

}  // namespace

std::vector<std::byte> encode_checkpoint(const CheckpointState& s) {
  Writer w;
  w.raw(kMagic, sizeof kMagic);
  w.u32(kCheckpointVersion);
  w.u32(0);
  w.u64(0);  // payload bytes, patched below
  w.str(s.model);
  w.u64(s.parameters.size());
  for (const auto& t : s.parameters) {
    w.str(t.name);
    w.u64(t.shape.size());
    for (std::uint64_t d : t.shape)
      w.u64(d);
    w.floats(t.values);
  }
  w.str(s.optimizer);
  w.u64(s.optimizer_steps);
  w.u64(s.optimizer_state.size());
  for (const auto& v : s.optimizer_state)
    w.floats(v);
  w.u64(s.step);
  w.u64(s.global_batch);
  w.u64(s.data_rows);
  w.u64(s.data_seed);
  w.str(s.auto_decisions);
  std::vector<std::byte>& bytes = w.bytes();
  const std::uint64_t payload = bytes.size() - kHeaderBytes;
  std::memcpy(bytes.data() + 16, &payload, sizeof payload);
  w.u64(fnv1a(bytes.data(), bytes.size()));
  return std::move(bytes);
}

CheckpointState decode_checkpoint(std::span<const std::byte> bytes, const std::string& source) {
  Reader header(bytes, source);
  if (bytes.size() < kHeaderBytes + 8) {
    header.fail("only " + std::to_string(bytes.size()) +
                " bytes (truncated; a checkpoint has at least " + std::to_string(kHeaderBytes + 8) +
                ")");
  }
  if (std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
    header.fail("not a gradcomm checkpoint (the file does not start with GRADCKPT)");
  }
  std::uint32_t version = 0;
  std::memcpy(&version, bytes.data() + 8, sizeof version);
  if (version != 1 && version != kCheckpointVersion) {
    header.fail("format version " + std::to_string(version) + "; this build reads versions 1 to " +
                std::to_string(kCheckpointVersion));
  }
  std::uint32_t reserved = 0;
  std::memcpy(&reserved, bytes.data() + 12, sizeof reserved);
  if (reserved != 0) {
    header.fail("reserved header field is " + std::to_string(reserved) +
                ", gradcomm writes 0 (corrupt)");
  }
  std::uint64_t payload = 0;
  std::memcpy(&payload, bytes.data() + 16, sizeof payload);
  if (payload != bytes.size() - kHeaderBytes - 8) {
    header.fail("the header announces " + std::to_string(payload) +
                " payload bytes, the file holds " +
                std::to_string(bytes.size() - kHeaderBytes - 8) + " (truncated or corrupt)");
  }
  std::uint64_t stored = 0;
  std::memcpy(&stored, bytes.data() + bytes.size() - 8, sizeof stored);
  if (stored != fnv1a(bytes.data(), bytes.size() - 8)) {
    header.fail("checksum mismatch: the file is corrupt");
  }

  Reader r(bytes.subspan(kHeaderBytes, payload), source);
  CheckpointState s;
  s.model = r.str();
  s.parameters.resize(r.length(16));
  for (auto& t : s.parameters) {
    t.name = r.str();
    t.shape.resize(r.length(8));
    for (auto& d : t.shape)
      d = r.u64();
    t.values = r.floats();
    std::uint64_t elements = 1;
    bool overflow = false;
    for (std::uint64_t d : t.shape) {
      if (d != 0 && elements > std::numeric_limits<std::uint64_t>::max() / d) overflow = true;
      elements *= d;
    }
    if (std::find(t.shape.begin(), t.shape.end(), std::uint64_t{0}) != t.shape.end()) {
      overflow = false;  // a zero dimension: no values, whatever the others
      elements = 0;
    }
    if (overflow || elements != t.values.size()) {
      r.fail("tensor '" + t.name + "': its shape holds " +
             (overflow ? std::string("more than 2^64") : std::to_string(elements)) +
             " values, the file has " + std::to_string(t.values.size()) + " (corrupt)");
    }
  }
  s.optimizer = r.str();
  s.optimizer_steps = r.u64();
  s.optimizer_state.resize(r.length(8));
  for (auto& v : s.optimizer_state)
    v = r.floats();
  s.step = r.u64();
  s.global_batch = r.u64();
  s.data_rows = r.u64();
  s.data_seed = r.u64();
  if (version >= 2) s.auto_decisions = r.str();
  if (!r.done()) r.fail("unexpected bytes after the last field");
  return s;
}

void write_file_atomically(const std::string& path, std::span<const std::byte> bytes) {
  auto fail = [&](const std::string& what) {
    throw Error(ErrorCode::invalid_argument,
                error_message("write checkpoint " + path, -1, what + ": " + std::strerror(errno)));
  };
  const std::filesystem::path target(path);
  const std::filesystem::path dir =
      target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    errno = ec.value();
    fail("cannot create directory " + dir.string());
  }
  const std::string host = host_name();
  std::string tmp = path;
  tmp.append(".tmp.").append(host).push_back('.');
  tmp.append(std::to_string(::getpid()));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create " + tmp);
  // Every later failure closes the file (if still open), removes it, and reports the first errno.
  auto abandon = [&](const std::string& what) {
    const int saved = errno;
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    errno = saved;
    fail(what);
  };
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) abandon("write to " + tmp + " failed");
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) abandon("fsync of " + tmp + " failed");
  const int closed = ::close(fd);
  fd = -1;
  if (closed != 0) abandon("close of " + tmp + " failed");
  if (::rename(tmp.c_str(), path.c_str()) != 0) abandon("rename of " + tmp + " failed");
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // best effort: makes the rename itself durable
    ::close(dfd);
  }
  remove_stale_temporaries(dir, target.filename().string(), host);
}

std::vector<std::byte> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) {
    throw InvalidArgument(error_message("load checkpoint " + path, -1,
                                        std::string("cannot open: ") + std::strerror(errno)));
  }
  const std::streamsize size = in.tellg();
  in.seekg(0);
  std::vector<std::byte> bytes(static_cast<std::size_t>(size));
  if (!in.read(reinterpret_cast<char*>(bytes.data()), size)) {
    throw InvalidArgument(error_message("load checkpoint " + path, -1, "read failed"));
  }
  return bytes;
}

}  // namespace gradcomm::trainer
