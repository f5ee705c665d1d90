// A main() for the fuzz targets when they are built without libFuzzer (the normal g++ build):
// runs LLVMFuzzerTestOneInput once on every file named, or on every file of every directory
// named, so the checked-in corpus is a regression test in CTest. A crash or abort fails it.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

void run_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t inputs = 0;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path arg(argv[i]);
    if (std::filesystem::is_directory(arg)) {
      for (const auto& entry : std::filesystem::recursive_directory_iterator(arg)) {
        if (!entry.is_regular_file()) continue;
        run_file(entry.path());
        ++inputs;
      }
    } else if (std::filesystem::is_regular_file(arg)) {
      run_file(arg);
      ++inputs;
    } else {
      std::fprintf(stderr, "%s: no such file or directory: %s\n", argv[0], argv[i]);
      return 2;
    }
  }
  if (inputs == 0) {
    std::fprintf(stderr, "%s: no inputs\n", argv[0]);
    return 2;
  }
  std::printf("%s: %zu inputs, no crash\n", argv[0], inputs);
  return 0;
}
