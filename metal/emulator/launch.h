// The host side of one emulated dispatch: reads the launch description and the input buffers
// the Python driver wrote into a folder, and writes the output buffers back there.
#pragma once

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "metal_shim.h"

namespace emu {

class Launch {
 public:
  // `dir/launch.txt` holds the grid, the threadgroup, then per input its rank, shape and
  // strides, then per output its size in bytes; buffers are `dir/in<i>.bin`, `dir/out<i>.bin`.
  explicit Launch(std::string dir) : dir_(std::move(dir)), text_(dir_ + "/launch.txt") {}

  uint3 dims() {
    uint3 d;
    text_ >> d.x >> d.y >> d.z;
    return d;
  }

  // The next input's bytes; its shape and strides go to `shape` and `strides`.
  std::vector<char> input(int i, std::vector<int>& shape, std::vector<int64_t>& strides, int& ndim) {
    text_ >> ndim;
    shape.resize(ndim);
    strides.resize(ndim);
    for (int& s : shape) text_ >> s;
    for (int64_t& s : strides) text_ >> s;
    std::ifstream file(dir_ + "/in" + std::to_string(i) + ".bin", std::ios::binary);
    return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
  }

  // The next output: its bytes start as 0xff (NaN for floats) so an element no thread writes shows.
  std::vector<char> output() {
    size_t bytes;
    text_ >> bytes;
    return std::vector<char>(bytes, char(0xff));
  }

  void save(int i, const std::vector<char>& data) {
    std::ofstream(dir_ + "/out" + std::to_string(i) + ".bin", std::ios::binary).write(data.data(), data.size());
  }

 private:
  std::string dir_;
  std::ifstream text_;
};

}  // namespace emu
