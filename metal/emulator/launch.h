// The host side of one emulated dispatch: reads the launch description and the input buffers
// the Python driver wrote into a folder, and writes the output buffers back there.
#pragma once

#include <array>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "lockstep.h"

namespace emu {

struct Input {
  std::vector<char> data;
  std::vector<int> shape;
  std::vector<int64_t> strides;  // in elements
  int ndim = 0;

  // CUDA kernels take the shape and strides by value, in arrays of MLX's MAX_NDIM (10).
  std::array<int32_t, 10> padded_shape() const {
    std::array<int32_t, 10> out{};
    std::copy(shape.begin(), shape.end(), out.begin());
    return out;
  }
  std::array<int64_t, 10> padded_strides() const {
    std::array<int64_t, 10> out{};
    std::copy(strides.begin(), strides.end(), out.begin());
    return out;
  }
};

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

  Input input(int i) {
    Input in;
    text_ >> in.ndim;
    in.shape.resize(in.ndim);
    in.strides.resize(in.ndim);
    for (int& s : in.shape) text_ >> s;
    for (int64_t& s : in.strides) text_ >> s;
    std::ifstream file(dir_ + "/in" + std::to_string(i) + ".bin", std::ios::binary);
    in.data.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
    return in;
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
