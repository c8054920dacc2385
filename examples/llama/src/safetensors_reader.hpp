// SPDX-License-Identifier: Apache-2.0
// Private: tensor access for model::load_hf on top of the core validating reader
// (include/medusa/io/safetensors.hpp), with its errors mapped to `load_error` and F32/BF16/F16
// tensors converted to float32 on read.
#pragma once

#include <medusa_llama/errors.hpp>
#include <medusa_llama/model.hpp>

#include <medusa/io/safetensors.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>

namespace medusa_llama::detail {

class safetensors_file {
 public:
  explicit safetensors_file(const std::filesystem::path& path) : path_(path.string()) {
    try {
      file_.emplace(medusa::safetensors_file::open(path));
    } catch (const medusa::safetensors_error& e) {
      throw load_error(classify(e.code()), e.what(), path_);
    } catch (const medusa::io_error& e) {
      throw load_error(load_errc::open_failed, e.what(), path_);
    }
  }

  [[nodiscard]] bool contains(const std::string& name) const { return file_->find(name) != nullptr; }

  // How tensor `name` is stored (F32, BF16, F16; f32 for anything else, which read_f32 rejects).
  [[nodiscard]] stored_type stored(const std::string& name) const {
    const medusa::safetensors_tensor* t = file_->find(name);
    using dt = medusa::safetensors_dtype;
    if (t != nullptr && t->dtype == dt::bf16) return stored_type::bf16;
    if (t != nullptr && t->dtype == dt::f16) return stored_type::f16;
    return stored_type::f32;
  }

  // Reads tensor `name`, which must hold rows × cols elements (shape [rows, cols], or [cols] when
  // rows == 1), into `out` as float32.
  void read_f32(const std::string& name, std::size_t rows, std::size_t cols, float* out) const {
    const medusa::safetensors_tensor* t = file_->find(name);
    if (t == nullptr) throw load_error(load_errc::missing_tensor, "tensor \"" + name + "\" is missing", path_);
    const bool shape_ok = (t->shape.size() == 2 && t->shape[0] == rows && t->shape[1] == cols) ||
                          (rows == 1 && t->shape.size() == 1 && t->shape[0] == cols);
    if (!shape_ok) {
      std::string s;
      for (auto v : t->shape) s += (s.empty() ? "" : ", ") + std::to_string(v);
      throw load_error(load_errc::size_mismatch, "tensor \"" + name + "\" has shape [" + s + "], expected [" +
                                                           std::to_string(rows) + ", " + std::to_string(cols) + "]", path_);
    }
    const auto raw = file_->data(*t);
    const std::size_t n = rows * cols;
    using dt = medusa::safetensors_dtype;
    if (t->dtype == dt::f32) {
      std::memcpy(out, raw.data(), n * sizeof(float));
    } else if (t->dtype == dt::bf16 || t->dtype == dt::f16) {
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t v;
        std::memcpy(&v, raw.data() + 2 * i, 2);
        out[i] = t->dtype == dt::bf16 ? bf16_to_f32(v) : f16_to_f32(v);
      }
    } else {
      throw load_error(load_errc::unsupported, "tensor \"" + name + "\" has dtype " +
                                                          std::string(medusa::dtype_name(t->dtype)) + " (F32, BF16, F16 only)", path_);
    }
  }

 private:
  static load_errc classify(medusa::safetensors_errc c) {
    using e = medusa::safetensors_errc;
    switch (c) {
      case e::file_too_small: case e::header_too_large: case e::range_out_of_bounds: return load_errc::truncated;
      case e::size_mismatch: return load_errc::size_mismatch;
      case e::header_not_json: case e::header_not_object: return load_errc::bad_json;
      default: return load_errc::bad_header;
    }
  }
  static float bf16_to_f32(std::uint16_t v) {
    const std::uint32_t u = static_cast<std::uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static float f16_to_f32(std::uint16_t h) {
    const std::uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    float v;
    if (exp == 0) v = std::ldexp(static_cast<float>(mant), -24);
    else if (exp == 31) v = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
    else v = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
    return sign ? -v : v;
  }
  std::string path_;
  std::optional<medusa::safetensors_file> file_;
};

}  // namespace medusa_llama::detail
