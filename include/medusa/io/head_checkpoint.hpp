// SPDX-License-Identifier: Apache-2.0
//! @file head_checkpoint.hpp
//! Loading and saving Medusa heads (layouts in docs/heads.md): owning `head_weights`, `load_heads`,
//! `save_heads`.
//!
//! Layouts read (detected from the tensor names, never from config.json):
//! * legacy Medusa-1 in safetensors: `{h}.{l}.linear.weight|bias`, `{h}.{L}.weight` (projection);
//!   the original `medusa_lm_head.pt` (zip/pickle) is rejected with a conversion hint;
//! * HF-style Medusa-2 / v1.0: `medusa_head.{h}.{l}.linear.weight|bias`, `medusa_head.{h}.{L}.weight`
//!   inside a model file, possibly sharded (`model.safetensors.index.json`); other tensors ignored;
//! * "version 2" heads: the same without projections; logits use the base model's lm_head.
//!
//! K and L are inferred from the tensors; config.json (`medusa_num_heads`, `medusa_num_layers`,
//! `hidden_size`, `vocab_size`, `version`) is only cross-checked. Loaded heads **own their memory**:
//! tensors are copied (and optionally converted) out of the memory-mapped files into one 64-byte
//! aligned arena laid out so that layer l of all heads is one [K·d, d] block; the files are unmapped
//! when `load_heads` returns. `save_heads` writes the HF-style names to `medusa_heads.safetensors`
//! plus a `config.json`, which `load_heads` reads back.
//!
//! @code
//! medusa::head_load_options opt;
//! opt.hidden_size = 4096;                 // the base model's d and V: a mismatch is an error
//! opt.vocab_size = 32000;
//! auto loaded = medusa::load_heads("/models/medusa-vicuna-7b", opt);
//! for (const auto& w : loaded.warnings) std::fprintf(stderr, "%s\n", w.message.c_str());
//! auto heads = loaded.heads.view();       // medusa::head_stack<> (per-head projections)
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>
#include <medusa/gemm.hpp>
#include <medusa/heads.hpp>
#include <medusa/io/json.hpp>
#include <medusa/io/safetensors.hpp>
#include <medusa/half.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <list>
#include <map>
#include <memory>
#include <random>
#include <new>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! Why a head checkpoint could not be loaded (or, for `config_mismatch`, a warning).
enum class checkpoint_errc : std::uint8_t {
  not_found,             //!< no file or no known checkpoint in the directory
  unsupported_format,    //!< `.pt`/`.bin` pickles (convert to safetensors), or an unknown file kind
  no_head_tensors,       //!< no Medusa head tensor in the files
  unknown_tensor,        //!< a key under the head prefix that is not a head tensor
  incomplete_heads,      //!< a gap in head indices, a missing layer, bias or projection
  bad_shape,             //!< a tensor whose shape is not [d,d], [d] or [V,d]
  unsupported_dtype,     //!< head tensors must be F32, F16 or BF16
  hidden_size_mismatch,  //!< d differs from the base model's (caller or config.json)
  vocab_size_mismatch,   //!< V differs from the base model's (caller or config.json)
  config_mismatch,       //!< config.json head/layer count or version disagrees with the tensors
  too_few_heads,         //!< fewer heads than `min_heads`
  bad_config,            //!< config.json or the shard index is malformed
  invalid_argument,      //!< bad arguments (sizes, missing lm_head, ...)
};

//! Short name of `e`.
constexpr std::string_view to_string(checkpoint_errc e) noexcept {
  constexpr std::string_view names[] = {"not_found",          "unsupported_format", "no_head_tensors",     "unknown_tensor",
                                        "incomplete_heads",   "bad_shape",          "unsupported_dtype",   "hidden_size_mismatch",
                                        "vocab_size_mismatch", "config_mismatch",   "too_few_heads",       "bad_config",
                                        "invalid_argument"};
  return names[static_cast<std::size_t>(e)];
}

//! A head checkpoint that cannot be used; `code()` says why.
class checkpoint_error : public coded_error<checkpoint_errc> {
 public:
  //! @param code why loading failed; @param what the message (prefixed with "heads: ").
  checkpoint_error(checkpoint_errc code, const std::string& what) : coded_error(code, "heads: " + what) {}
};

//! A non-fatal finding of `load_heads` (today only `config_mismatch`).
struct checkpoint_warning {
  checkpoint_errc code;  //!< what kind of finding
  std::string message;   //!< human-readable, names both numbers
};

namespace detail {

struct aligned_bytes_delete {
  void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }
};

// Converts n elements between weight dtypes; src may be unaligned (it comes from a file).
inline void convert_weights(const std::byte* src, weight_dtype sdt, std::byte* dst, weight_dtype ddt, std::size_t n) noexcept {
  if (sdt == ddt) {
    std::memcpy(dst, src, n * dtype_size(sdt));
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    float f = 0.0f;
    if (sdt == weight_dtype::f32) {
      std::memcpy(&f, src + 4 * i, 4);
    } else {
      std::uint16_t u = 0;
      std::memcpy(&u, src + 2 * i, 2);
      f = sdt == weight_dtype::f16 ? half_bits_to_float(u) : bfloat16_bits_to_float(u);
    }
    if (ddt == weight_dtype::f32) {
      std::memcpy(dst + 4 * i, &f, 4);
    } else {
      const std::uint16_t u = ddt == weight_dtype::f16 ? float_to_half_bits(f) : float_to_bfloat16_bits(f);
      std::memcpy(dst + 2 * i, &u, 2);
    }
  }
}

inline std::optional<weight_dtype> to_weight_dtype(safetensors_dtype t) noexcept {
  switch (t) {
    case safetensors_dtype::f32: return weight_dtype::f32;
    case safetensors_dtype::f16: return weight_dtype::f16;
    case safetensors_dtype::bf16: return weight_dtype::bf16;
    default: return std::nullopt;
  }
}

inline safetensors_dtype to_safetensors_dtype(weight_dtype t) noexcept {
  return t == weight_dtype::f32 ? safetensors_dtype::f32 : t == weight_dtype::f16 ? safetensors_dtype::f16 : safetensors_dtype::bf16;
}

inline std::size_t checked_mul(std::size_t a, std::size_t b) {
  if (a != 0 && b > SIZE_MAX / a) throw checkpoint_error(checkpoint_errc::invalid_argument, "head sizes overflow");
  return a * b;
}

}  // namespace detail

//! Medusa heads that own their weights (one aligned arena, one dtype).
//!
//! Layout: W [L][K][d][d] (layer l of all heads is one contiguous [K·d, d] matrix, so `view()`
//! enables the fused first-layer GEMM), then b [L][K][d], then U [K][V][d] for per-head projections.
//! Views stay valid while the object lives, including after it is moved.
class head_weights {
 public:
  head_weights() = default;

  //! Zero-filled heads. For `shared_lm_head`, `vocab` may be 0 (unknown) until a view is made.
  head_weights(std::size_t hidden, std::size_t vocab, std::size_t heads, std::size_t layers, projection_kind kind,
               weight_dtype dtype)
      : d_(hidden), v_(vocab), k_(heads), l_(layers), kind_(kind), dtype_(dtype) {
    if (hidden == 0 || heads == 0 || (kind == projection_kind::per_head && vocab == 0))
      throw checkpoint_error(checkpoint_errc::invalid_argument, "head_weights needs d > 0, K > 0 and (per-head projections) V > 0; got d=" +
                                                                    std::to_string(hidden) + " V=" + std::to_string(vocab) + " K=" + std::to_string(heads));
    using detail::checked_mul;
    const std::size_t blocks = checked_mul(heads, layers);
    std::size_t n = checked_mul(blocks, checked_mul(hidden, hidden));
    n += checked_mul(blocks, hidden);
    if (kind == projection_kind::per_head) n += checked_mul(heads, checked_mul(vocab, hidden));
    bytes_ = checked_mul(n, dtype_size(dtype));
    arena_.reset(static_cast<std::byte*>(::operator new[](std::max<std::size_t>(bytes_, 1), std::align_val_t{64})));
    std::memset(arena_.get(), 0, bytes_);
  }

  head_weights(head_weights&&) noexcept = default;
  head_weights& operator=(head_weights&&) noexcept = default;
  //! Deep copy.
  head_weights(const head_weights& o) : head_weights() { *this = o; }
  //! Deep copy.
  head_weights& operator=(const head_weights& o) {
    if (this == &o) return *this;
    head_weights tmp;
    tmp.d_ = o.d_, tmp.v_ = o.v_, tmp.k_ = o.k_, tmp.l_ = o.l_, tmp.kind_ = o.kind_, tmp.dtype_ = o.dtype_, tmp.bytes_ = o.bytes_;
    if (o.arena_) {
      tmp.arena_.reset(static_cast<std::byte*>(::operator new[](std::max<std::size_t>(o.bytes_, 1), std::align_val_t{64})));
      std::memcpy(tmp.arena_.get(), o.arena_.get(), o.bytes_);
    }
    return *this = std::move(tmp);
  }

  [[nodiscard]] std::size_t hidden_size() const noexcept { return d_; }   //!< d
  [[nodiscard]] std::size_t vocab_size() const noexcept { return v_; }    //!< V (0 = unknown, shared variant only)
  [[nodiscard]] std::size_t num_heads() const noexcept { return k_; }     //!< K
  [[nodiscard]] std::size_t num_layers() const noexcept { return l_; }    //!< L
  [[nodiscard]] projection_kind kind() const noexcept { return kind_; }   //!< projection variant
  [[nodiscard]] weight_dtype dtype() const noexcept { return dtype_; }    //!< element type of every tensor
  [[nodiscard]] std::size_t size_bytes() const noexcept { return bytes_; } //!< arena size
  [[nodiscard]] bool empty() const noexcept { return k_ == 0; }           //!< default-constructed

  //! W_{h,l} [d,d] as bytes.
  [[nodiscard]] std::span<std::byte> resblock_weight_bytes(std::size_t h, std::size_t l) {
    check(h, l);
    return span_at(((l * k_) + h) * d_ * d_, d_ * d_);
  }
  //! b_{h,l} [d] as bytes.
  [[nodiscard]] std::span<std::byte> resblock_bias_bytes(std::size_t h, std::size_t l) {
    check(h, l);
    return span_at(l_ * k_ * d_ * d_ + ((l * k_) + h) * d_, d_);
  }
  //! U_h [V,d] as bytes (per-head variant).
  [[nodiscard]] std::span<std::byte> projection_bytes(std::size_t h) {
    check(h, 0, false);
    if (kind_ != projection_kind::per_head) throw checkpoint_error(checkpoint_errc::invalid_argument, "shared-projection heads have no projection");
    return span_at(l_ * k_ * d_ * d_ + l_ * k_ * d_ + h * v_ * d_, v_ * d_);
  }
  //! W_{h,l} as a typed pointer.
  [[nodiscard]] weight_ptr resblock_weight(std::size_t h, std::size_t l) const { return ptr(const_cast<head_weights*>(this)->resblock_weight_bytes(h, l)); }
  //! b_{h,l} as a typed pointer.
  [[nodiscard]] weight_ptr resblock_bias(std::size_t h, std::size_t l) const { return ptr(const_cast<head_weights*>(this)->resblock_bias_bytes(h, l)); }
  //! U_h as a typed pointer.
  [[nodiscard]] weight_ptr projection(std::size_t h) const { return ptr(const_cast<head_weights*>(this)->projection_bytes(h)); }

  //! Views for the forward pass (per-head variant). Static counts must match the loaded ones.
  template <std::size_t H = std::dynamic_extent, std::size_t L = std::dynamic_extent>
  [[nodiscard]] head_stack<H, L> view() const {
    if (kind_ != projection_kind::per_head)
      throw checkpoint_error(checkpoint_errc::invalid_argument, "these heads share the base lm_head: call view(lm_head, vocab)");
    head_stack<H, L> s(d_, v_, k_, l_, kind_);
    fill(s);
    for (std::size_t h = 0; h < k_; ++h) s.set_projection(h, projection(h));
    return s;
  }
  //! Views for the forward pass (shared-projection variant): `lm_head` [vocab, d] of the base model.
  template <std::size_t H = std::dynamic_extent, std::size_t L = std::dynamic_extent>
  [[nodiscard]] head_stack<H, L> view(weight_ptr lm_head, std::size_t vocab) const {
    if (kind_ != projection_kind::shared_lm_head)
      throw checkpoint_error(checkpoint_errc::invalid_argument, "these heads have their own projections: call view()");
    if (v_ != 0 && vocab != v_)
      throw checkpoint_error(checkpoint_errc::vocab_size_mismatch, "lm_head has vocab " + std::to_string(vocab) + ", the heads were loaded for " + std::to_string(v_));
    head_stack<H, L> s(d_, vocab, k_, l_, kind_);
    fill(s);
    s.set_lm_head(lm_head);
    return s;
  }

  //! A copy with every tensor converted to `dtype` (e.g. bf16 → f32 once, for BLAS).
  [[nodiscard]] head_weights to_dtype(weight_dtype dtype) const {
    head_weights out(d_, v_, k_, l_, kind_, dtype);
    detail::convert_weights(arena_.get(), dtype_, out.arena_.get(), dtype, bytes_ / dtype_size(dtype_));
    return out;
  }

  //! Fresh heads initialised as the training recipe does: ResBlock W = 0, bias uniform
  //! in ±1/√d (seeded), projections = copies of `lm_head` [V,d] (per-head variant; may be null to
  //! leave them zero).
  static head_weights initialize(std::size_t hidden, std::size_t vocab, std::size_t heads, std::size_t layers, projection_kind kind,
                                 weight_dtype dtype, weight_ptr lm_head, std::uint64_t seed) {
    head_weights w(hidden, vocab, heads, layers, kind, dtype);
    const float bound = 1.0f / std::sqrt(static_cast<float>(hidden));
    std::uint64_t state = seed;
    std::vector<float> b(hidden);
    for (std::size_t l = 0; l < layers; ++l)
      for (std::size_t h = 0; h < heads; ++h) {
        for (auto& x : b) {
          // splitmix64 -> uniform [-bound, bound)
          std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
          z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
          z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
          z ^= z >> 31;
          x = (static_cast<float>(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * bound;
        }
        detail::convert_weights(reinterpret_cast<const std::byte*>(b.data()), weight_dtype::f32, w.resblock_bias_bytes(h, l).data(), dtype, hidden);
      }
    if (kind == projection_kind::per_head && lm_head.data != nullptr)
      for (std::size_t h = 0; h < heads; ++h)
        detail::convert_weights(static_cast<const std::byte*>(lm_head.data), lm_head.dtype, w.projection_bytes(h).data(), dtype, vocab * hidden);
    return w;
  }

  //! Seeded random heads for tests, demos and benchmarks: `initialize` (projections = copies of
  //! `lm_head`, seeded biases), then every ResBlock weight drawn from N(0, 1/d), so that each head
  //! perturbs the hidden state and proposes its own tokens. Same arguments, same weights.
  //! @code
  //! auto w = medusa::head_weights::random(d, vocab, 4, 1, medusa::weight_dtype::f32,
  //!                                       medusa::weight_ptr::of(lm_head), /*seed=*/17);
  //! @endcode
  static head_weights random(std::size_t hidden, std::size_t vocab, std::size_t heads, std::size_t layers,
                             weight_dtype dtype, weight_ptr lm_head, std::uint64_t seed) {
    head_weights w = initialize(hidden, vocab, heads, layers, projection_kind::per_head, weight_dtype::f32, lm_head, seed);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(hidden)));
    for (std::size_t l = 0; l < layers; ++l)
      for (std::size_t h = 0; h < heads; ++h) {
        auto* f = reinterpret_cast<float*>(w.resblock_weight_bytes(h, l).data());
        for (std::size_t i = 0; i < hidden * hidden; ++i) f[i] = normal(rng);
      }
    return dtype == weight_dtype::f32 ? w : w.to_dtype(dtype);
  }

 private:
  friend struct head_loader;
  void check(std::size_t h, std::size_t l, bool layer = true) const {
    if (h >= k_ || (layer && l >= l_))
      throw checkpoint_error(checkpoint_errc::invalid_argument, "head " + std::to_string(h) + (layer ? " layer " + std::to_string(l) : std::string()) +
                                                                    " out of range (K=" + std::to_string(k_) + ", L=" + std::to_string(l_) + ")");
  }
  std::span<std::byte> span_at(std::size_t elem_offset, std::size_t n) const {
    const std::size_t s = dtype_size(dtype_);
    return {arena_.get() + elem_offset * s, n * s};
  }
  weight_ptr ptr(std::span<std::byte> s) const { return {s.data(), dtype_}; }
  template <class S>
  void fill(S& s) const {
    for (std::size_t h = 0; h < k_; ++h)
      for (std::size_t l = 0; l < l_; ++l) s.set_resblock(h, l, resblock_weight(h, l), resblock_bias(h, l));
  }

  std::size_t d_ = 0, v_ = 0, k_ = 0, l_ = 0;
  projection_kind kind_ = projection_kind::per_head;
  weight_dtype dtype_ = weight_dtype::f32;
  std::size_t bytes_ = 0;
  std::unique_ptr<std::byte[], detail::aligned_bytes_delete> arena_;
};

//! Options of `load_heads`.
struct head_load_options {
  std::size_t hidden_size = 0;  //!< the base model's d; a different d is an error (0 = not checked)
  std::size_t vocab_size = 0;   //!< the base model's V; a different V is an error (0 = not checked)
  std::size_t min_heads = 0;    //!< fewer heads (e.g. than the tree's depth) is an error
  bool strict_config = false;   //!< turn config.json disagreements into errors
  std::optional<weight_dtype> dtype;  //!< convert on load (default: the checkpoint's dtype, f32 if mixed)
};

//! Which layout a checkpoint used.
enum class head_checkpoint_format : std::uint8_t {
  legacy,      //!< bare `{h}.{l}.linear.*` keys (medusa_lm_head.safetensors)
  hf,          //!< `medusa_head.{h}.…` keys in one model file
  hf_sharded,  //!< `medusa_head.{h}.…` keys in shards listed by an index.json
};

//! What `load_heads` returns.
struct head_load_result {
  head_weights heads;                            //!< the owned weights
  head_checkpoint_format format{};               //!< detected layout
  std::vector<checkpoint_warning> warnings;      //!< config.json disagreements (non-strict mode)
  std::vector<std::filesystem::path> files;      //!< the weight files read
  std::optional<std::filesystem::path> config;   //!< the config.json consulted, if any
};

//! Internals of `load_heads`, exposed as a struct so tests and tools can drive them on in-memory files.
struct head_loader {
  //! Prefix of head tensors in HF-style model files.
  static constexpr std::string_view hf_prefix = "medusa_head.";

  //! A head tensor name without prefix.
  struct key {
    enum class part : std::uint8_t { linear_weight, linear_bias, projection };
    std::size_t head = 0;   //!< h
    std::size_t index = 0;  //!< l (linear) or the projection's module index
    part what = part::linear_weight;
  };

  //! Parses `{h}.{l}.linear.weight`, `{h}.{l}.linear.bias` or `{h}.{j}.weight` (no prefix).
  static std::optional<key> parse_key(std::string_view s) noexcept {
    auto number = [&](std::size_t& out) -> bool {
      std::size_t n = 0, len = 0;
      while (len < s.size() && s[len] >= '0' && s[len] <= '9') {
        if (len >= 6) return false;  // indices beyond 999999 are not heads
        n = n * 10 + static_cast<std::size_t>(s[len] - '0');
        ++len;
      }
      if (len == 0 || (len > 1 && s[0] == '0') || len >= s.size() || s[len] != '.') return false;
      out = n;
      s.remove_prefix(len + 1);
      return true;
    };
    key k;
    if (!number(k.head) || !number(k.index)) return std::nullopt;
    if (s == "linear.weight") k.what = key::part::linear_weight;
    else if (s == "linear.bias") k.what = key::part::linear_bias;
    else if (s == "weight") k.what = key::part::projection;
    else return std::nullopt;
    return k;
  }

  //! Reads `config.json` text into the fields the loader cross-checks.
  struct config_fields {
    std::optional<std::uint64_t> num_heads, num_layers, hidden_size, vocab_size;
    std::optional<std::string> version;
  };
  //! Parses config.json; malformed JSON or wrong field types are `bad_config`.
  static config_fields parse_config(std::string_view text, const std::string& where) {
    json_value v;
    try {
      v = parse_json(text);
    } catch (const json_error& e) {
      throw checkpoint_error(checkpoint_errc::bad_config, where + ": " + std::string(e.what()).substr(8));  // drop "medusa: "
    }
    if (!v.is_object()) throw checkpoint_error(checkpoint_errc::bad_config, where + ": not a JSON object");
    config_fields c;
    auto uint_field = [&](const char* name, std::optional<std::uint64_t>& out) {
      if (const auto* f = v.find(name); f != nullptr && !f->is_null()) {
        out = f->as_uint64();
        if (!out) throw checkpoint_error(checkpoint_errc::bad_config, where + ": \"" + name + "\" is not a non-negative integer");
      }
    };
    uint_field("medusa_num_heads", c.num_heads);
    uint_field("medusa_num_layers", c.num_layers);
    uint_field("hidden_size", c.hidden_size);
    uint_field("vocab_size", c.vocab_size);
    if (const auto* f = v.find("version"); f != nullptr && !f->is_null()) {
      if (f->is_string()) c.version = f->as_string();
      else if (const auto n = f->as_uint64()) c.version = std::to_string(*n);
      else throw checkpoint_error(checkpoint_errc::bad_config, where + ": \"version\" is neither a string nor an integer");
    }
    return c;
  }

  //! Builds heads from already opened files (all their head tensors) and an optional config.
  //! `names` labels the files in messages.
  static head_load_result load(std::span<const safetensors_file> files, std::span<const std::string> names,
                               const std::optional<config_fields>& config, const head_load_options& opt) {
    struct ref {
      const safetensors_file* file;
      const safetensors_tensor* tensor;
      std::string label;  // full name for messages
    };
    auto file_name = [&](std::size_t i) { return i < names.size() ? names[i] : "file #" + std::to_string(i); };
    // Prefix mode as soon as any file has HF-style keys; then other tensors are base weights.
    bool prefixed = false;
    for (const auto& f : files)
      for (const auto& t : f.tensors())
        if (t.name.rfind(hf_prefix, 0) == 0) prefixed = true;
    std::map<std::size_t, std::map<std::size_t, std::pair<std::optional<ref>, std::optional<ref>>>> linear;  // h -> l -> (W, b)
    std::map<std::size_t, std::vector<std::pair<std::size_t, ref>>> proj;                                    // h -> [(j, U)]
    std::size_t found = 0;
    std::optional<std::string> first_unknown;
    std::map<std::string, std::size_t> seen;
    for (std::size_t fi = 0; fi < files.size(); ++fi)
      for (const auto& t : files[fi].tensors()) {
        std::string_view name = t.name;
        if (prefixed) {
          if (name.rfind(hf_prefix, 0) != 0) continue;
          name.remove_prefix(hf_prefix.size());
        }
        const auto k = parse_key(name);
        if (!k) {
          if (prefixed)
            throw checkpoint_error(checkpoint_errc::unknown_tensor, "unknown tensor '" + t.name + "' in " + file_name(fi) +
                                                                        " (expected medusa_head.{h}.{l}.linear.weight|bias or medusa_head.{h}.{L}.weight)");
          if (!first_unknown) first_unknown = t.name + "' in " + file_name(fi);  // reported if heads are found
          continue;
        }
        if (auto [it, fresh] = seen.emplace(t.name, fi); !fresh)
          throw checkpoint_error(checkpoint_errc::bad_config, "tensor '" + t.name + "' appears in both " + file_name(it->second) + " and " + file_name(fi));
        ++found;
        const ref r{&files[fi], &t, t.name};
        if (k->what == key::part::projection) proj[k->head].emplace_back(k->index, r);
        else if (k->what == key::part::linear_weight) linear[k->head][k->index].first = r;
        else linear[k->head][k->index].second = r;
      }
    if (found == 0) {
      std::string what = "no Medusa head tensors found in ";
      for (std::size_t i = 0; i < files.size(); ++i) { if (i) what += ", "; what += file_name(i); }
      throw checkpoint_error(checkpoint_errc::no_head_tensors, what + " (expected {h}.{l}.linear.weight or medusa_head.{h}.{l}.linear.weight keys)");
    }
    if (first_unknown)
      throw checkpoint_error(checkpoint_errc::unknown_tensor, "unknown tensor '" + *first_unknown +
                                                                  " among Medusa head tensors (expected {h}.{l}.linear.weight|bias or {h}.{L}.weight)");
    const std::string pfx = prefixed ? std::string(hf_prefix) : std::string();

    // Head count: indices must be 0..K-1 without gaps.
    std::size_t max_head = 0;
    for (const auto& [h, _] : linear) max_head = std::max(max_head, h);
    for (const auto& [h, _] : proj) max_head = std::max(max_head, h);
    const std::size_t K = max_head + 1;
    for (std::size_t h = 0; h < K; ++h)
      if (!linear.contains(h) && !proj.contains(h))
        throw checkpoint_error(checkpoint_errc::incomplete_heads, "head indices have a gap: no tensor of head " + std::to_string(h) +
                                                                      " although head " + std::to_string(max_head) + " exists (" + std::to_string(K) + " heads implied)");
    std::size_t L = 0;
    for (const auto& [h, layers] : linear)
      for (const auto& [l, _] : layers) L = std::max(L, l + 1);
    for (std::size_t h = 0; h < K; ++h)
      for (std::size_t l = 0; l < L; ++l) {
        const auto hit = linear.find(h);
        const auto* wb = hit == linear.end() ? nullptr : (hit->second.contains(l) ? &hit->second.at(l) : nullptr);
        if (wb == nullptr || !wb->first || !wb->second) {
          const bool has_w = wb != nullptr && wb->first;
          throw checkpoint_error(checkpoint_errc::incomplete_heads, "missing tensor '" + pfx + std::to_string(h) + "." + std::to_string(l) +
                                                                        (has_w ? ".linear.bias" : ".linear.weight") + "' (heads have " + std::to_string(L) + " ResBlock layers)");
        }
      }
    const projection_kind kind = proj.empty() ? projection_kind::shared_lm_head : projection_kind::per_head;
    if (kind == projection_kind::per_head)
      for (std::size_t h = 0; h < K; ++h) {
        const auto it = proj.find(h);
        if (it == proj.end())
          throw checkpoint_error(checkpoint_errc::incomplete_heads, "missing tensor '" + pfx + std::to_string(h) + "." + std::to_string(L) +
                                                                        ".weight' (the projection of head " + std::to_string(h) + "; other heads have one)");
        for (const auto& [j, r] : it->second)
          if (j != L)
            throw checkpoint_error(checkpoint_errc::unknown_tensor, "tensor '" + r.label + "': a projection at module index " + std::to_string(j) +
                                                                        ", but heads have " + std::to_string(L) + " ResBlock layers (expected '" + pfx +
                                                                        std::to_string(h) + "." + std::to_string(L) + ".weight' only)");
      }

    // Shapes and dtypes.
    auto dtype_of = [&](const ref& r) {
      const auto dt = detail::to_weight_dtype(r.tensor->dtype);
      if (!dt)
        throw checkpoint_error(checkpoint_errc::unsupported_dtype, "tensor '" + r.label + "' has dtype " + std::string(dtype_name(r.tensor->dtype)) +
                                                                       "; head tensors must be F32, F16 or BF16");
      return *dt;
    };
    auto shape_str = [](const std::vector<std::uint64_t>& s) {
      std::string out = "[";
      for (std::size_t i = 0; i < s.size(); ++i) { if (i) out += ", "; out += std::to_string(s[i]); }
      return out + "]";
    };
    std::size_t d = 0, V = 0;
    if (L > 0) {
      const auto& w = *linear.at(0).at(0).first;
      if (w.tensor->shape.size() != 2 || w.tensor->shape[0] == 0)
        throw checkpoint_error(checkpoint_errc::bad_shape, "tensor '" + w.label + "' has shape " + shape_str(w.tensor->shape) + ", expected [d, d]");
      d = static_cast<std::size_t>(w.tensor->shape[0]);
    }
    if (kind == projection_kind::per_head) {
      const auto& u = proj.at(0).front().second;
      if (u.tensor->shape.size() != 2 || u.tensor->shape[0] == 0 || u.tensor->shape[1] == 0)
        throw checkpoint_error(checkpoint_errc::bad_shape, "tensor '" + u.label + "' has shape " + shape_str(u.tensor->shape) + ", expected [V, d]");
      V = static_cast<std::size_t>(u.tensor->shape[0]);
      if (L == 0) d = static_cast<std::size_t>(u.tensor->shape[1]);
    }
    if (opt.hidden_size != 0 && d != opt.hidden_size)
      throw checkpoint_error(checkpoint_errc::hidden_size_mismatch, "the heads have hidden size " + std::to_string(d) + " but the base model has " + std::to_string(opt.hidden_size));
    if (config && config->hidden_size && *config->hidden_size != d)
      throw checkpoint_error(checkpoint_errc::hidden_size_mismatch, "the heads have hidden size " + std::to_string(d) + " but config.json says hidden_size = " + std::to_string(*config->hidden_size));
    if (kind == projection_kind::per_head) {
      if (opt.vocab_size != 0 && V != opt.vocab_size)
        throw checkpoint_error(checkpoint_errc::vocab_size_mismatch, "the heads project to vocab size " + std::to_string(V) + " but the base model has " + std::to_string(opt.vocab_size));
      if (config && config->vocab_size && *config->vocab_size != V)
        throw checkpoint_error(checkpoint_errc::vocab_size_mismatch, "the heads project to vocab size " + std::to_string(V) + " but config.json says vocab_size = " + std::to_string(*config->vocab_size));
    } else {
      V = opt.vocab_size != 0 ? opt.vocab_size : (config && config->vocab_size ? static_cast<std::size_t>(*config->vocab_size) : 0);
    }
    auto expect_shape = [&](const ref& r, std::vector<std::uint64_t> want, const char* what) {
      if (r.tensor->shape != want)
        throw checkpoint_error(checkpoint_errc::bad_shape, "tensor '" + r.label + "' has shape " + shape_str(r.tensor->shape) + ", expected " + what + " = " + shape_str(want));
    };
    std::optional<weight_dtype> common;
    bool mixed = false;
    auto note_dtype = [&](const ref& r) {
      const auto dt = dtype_of(r);
      if (common && *common != dt) mixed = true;
      common = dt;
    };
    for (std::size_t h = 0; h < K; ++h) {
      for (std::size_t l = 0; l < L; ++l) {
        const auto& [w, b] = linear.at(h).at(l);
        expect_shape(*w, {d, d}, "[d, d]");
        expect_shape(*b, {d}, "[d]");
        note_dtype(*w);
        note_dtype(*b);
      }
      if (kind == projection_kind::per_head) {
        const auto& u = proj.at(h).front().second;
        expect_shape(u, {V, d}, "[V, d]");
        note_dtype(u);
      }
    }

    // Config cross-checks: the tensors win; disagreement is a warning unless strict.
    head_load_result result;
    auto mismatch = [&](const std::string& msg) {
      if (opt.strict_config) throw checkpoint_error(checkpoint_errc::config_mismatch, msg);
      result.warnings.push_back({checkpoint_errc::config_mismatch, msg});
    };
    if (config) {
      if (config->num_heads && *config->num_heads != K)
        mismatch("config.json says medusa_num_heads = " + std::to_string(*config->num_heads) + " but the tensors hold " + std::to_string(K) + " heads; using " + std::to_string(K));
      if (config->num_layers && *config->num_layers != L)
        mismatch("config.json says medusa_num_layers = " + std::to_string(*config->num_layers) + " but the tensors hold " + std::to_string(L) + " ResBlock layers; using " + std::to_string(L));
      if (config->version && *config->version == "2" && kind == projection_kind::per_head)
        mismatch("config.json says version \"2\" (shared lm_head) but every head has its own projection; using the projections");
    }
    if (K < opt.min_heads)
      throw checkpoint_error(checkpoint_errc::too_few_heads, "the checkpoint has " + std::to_string(K) + " heads, at least " + std::to_string(opt.min_heads) + " are required");

    const weight_dtype target = opt.dtype ? *opt.dtype : (mixed || !common ? weight_dtype::f32 : *common);
    head_weights w(d, V, K, L, kind, target);
    auto copy = [&](const ref& r, std::span<std::byte> dst) {
      const auto src = r.file->data(*r.tensor);
      detail::convert_weights(src.data(), dtype_of(r), dst.data(), target, static_cast<std::size_t>(r.tensor->numel()));
    };
    for (std::size_t h = 0; h < K; ++h) {
      for (std::size_t l = 0; l < L; ++l) {
        copy(*linear.at(h).at(l).first, w.resblock_weight_bytes(h, l));
        copy(*linear.at(h).at(l).second, w.resblock_bias_bytes(h, l));
      }
      if (kind == projection_kind::per_head) copy(proj.at(h).front().second, w.projection_bytes(h));
    }
    result.heads = std::move(w);
    result.format = prefixed ? head_checkpoint_format::hf : head_checkpoint_format::legacy;
    return result;
  }
};

namespace detail {

inline std::string read_text_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw io_error("cannot open " + p.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw io_error("cannot read " + p.string());
  return ss.str();
}

[[noreturn]] inline void reject_pickle(const std::filesystem::path& p) {
  throw checkpoint_error(checkpoint_errc::unsupported_format,
                         p.string() + " is a PyTorch pickle, which medusa does not read; convert it once with: python -c \"import torch; "
                                      "from safetensors.torch import save_file; sd = torch.load('" + p.filename().string() +
                                      "', map_location='cpu'); save_file({k: v.contiguous().clone() for k, v in sd.items()}, '" +
                                      p.stem().string() + ".safetensors')\"");
}

}  // namespace detail

//! Loads Medusa heads from a checkpoint directory or file (see the file comment for layouts).
//!
//! A directory is searched for, in order: `medusa_lm_head.safetensors`, `medusa_heads.safetensors`,
//! `model.safetensors.index.json`, `model.safetensors`; a `medusa_lm_head.pt`/`pytorch_model.bin`
//! alone is rejected with a conversion hint. `config.json` next to the weights is cross-checked.
//! Throws `checkpoint_error` (an `invalid_input`) for unusable checkpoints, `safetensors_error` for
//! corrupt files and `io_error` when files cannot be read.
inline head_load_result load_heads(const std::filesystem::path& path, const head_load_options& opt = {}) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path weights;
  if (fs::is_directory(path, ec)) {
    for (const char* cand : {"medusa_lm_head.safetensors", "medusa_heads.safetensors", "model.safetensors.index.json", "model.safetensors"})
      if (fs::is_regular_file(path / cand, ec)) {
        weights = path / cand;
        break;
      }
    if (weights.empty()) {
      for (const char* cand : {"medusa_lm_head.pt", "pytorch_model.bin"})
        if (fs::exists(path / cand, ec)) detail::reject_pickle(path / cand);
      throw checkpoint_error(checkpoint_errc::not_found, "no Medusa checkpoint in " + path.string() +
                                                             " (looked for medusa_lm_head.safetensors, medusa_heads.safetensors, model.safetensors.index.json, model.safetensors)");
    }
  } else if (fs::is_regular_file(path, ec)) {
    weights = path;
  } else {
    throw checkpoint_error(checkpoint_errc::not_found, path.string() + " does not exist");
  }
  const std::string ext = weights.extension().string();
  if (ext == ".pt" || ext == ".bin" || ext == ".pth") detail::reject_pickle(weights);
  const fs::path dir = weights.parent_path();

  std::optional<head_loader::config_fields> config;
  std::optional<fs::path> config_path;
  if (fs::is_regular_file(dir / "config.json", ec)) {
    config_path = dir / "config.json";
    config = head_loader::parse_config(detail::read_text_file(*config_path), config_path->string());
  }

  std::vector<safetensors_file> files;
  std::vector<std::string> names;
  std::vector<fs::path> paths;
  bool sharded = false;
  if (ext == ".json") {
    sharded = true;
    const std::string where = weights.string();
    json_value index;
    try {
      index = parse_json(detail::read_text_file(weights));
    } catch (const json_error& e) {
      throw checkpoint_error(checkpoint_errc::bad_config, where + ": " + std::string(e.what()).substr(8));  // drop "medusa: "
    }
    const json_value* map = index.find("weight_map");
    if (map == nullptr || !map->is_object()) throw checkpoint_error(checkpoint_errc::bad_config, where + ": no \"weight_map\" object");
    std::vector<std::string> shard_names;
    std::vector<std::pair<std::string, std::string>> head_keys;  // tensor -> shard
    for (std::size_t i = 0; i < map->size(); ++i) {
      if (!map->value(i).is_string()) throw checkpoint_error(checkpoint_errc::bad_config, where + ": weight_map entry '" + map->key(i) + "' is not a string");
      if (map->key(i).rfind(head_loader::hf_prefix, 0) != 0) continue;
      const std::string& shard = map->value(i).as_string();
      // Shards are plain file names next to the index: no directories, no escaping the checkpoint.
      if (shard.empty() || shard.find('/') != std::string::npos || shard.find('\\') != std::string::npos || shard == "." || shard == "..")
        throw checkpoint_error(checkpoint_errc::bad_config, where + ": shard name '" + shard + "' is not a plain file name");
      head_keys.emplace_back(map->key(i), shard);
      if (std::find(shard_names.begin(), shard_names.end(), shard) == shard_names.end()) shard_names.push_back(shard);
    }
    if (head_keys.empty()) throw checkpoint_error(checkpoint_errc::no_head_tensors, where + " lists no medusa_head.* tensors");
    for (const auto& s : shard_names) {
      files.push_back(safetensors_file::open(dir / s));
      names.push_back((dir / s).string());
      paths.push_back(dir / s);
    }
    for (const auto& [tensor, shard] : head_keys) {
      const auto idx = static_cast<std::size_t>(std::find(shard_names.begin(), shard_names.end(), shard) - shard_names.begin());
      if (files[idx].find(tensor) == nullptr)
        throw checkpoint_error(checkpoint_errc::incomplete_heads, "tensor '" + tensor + "' is listed in " + where + " but missing from " + names[idx]);
    }
  } else {
    files.push_back(safetensors_file::open(weights));
    names.push_back(weights.string());
    paths.push_back(weights);
  }
  head_load_result r = head_loader::load(files, names, config, opt);
  if (sharded) r.format = head_checkpoint_format::hf_sharded;
  r.files = std::move(paths);
  r.config = config_path;
  return r;
}

//! Options of `save_heads`.
struct head_save_options {
  std::optional<weight_dtype> dtype;                        //!< convert on save (default: keep)
  std::string weights_file = "medusa_heads.safetensors";    //!< file name inside the directory
  std::string base_model_name_or_path;                      //!< recorded in config.json if non-empty
  bool write_config = true;                                 //!< write (overwrite) `config.json`
};

//! Saves heads in the HF-style layout (`medusa_head.{h}.{l}.linear.weight|bias`,
//! `medusa_head.{h}.{L}.weight` unless shared-projection) to `dir/options.weights_file`, plus a
//! `config.json` with `medusa_num_heads`, `medusa_num_layers`, `hidden_size`, `vocab_size`,
//! `torch_dtype` (and `version: "2"` for shared-projection heads). Creates `dir` if needed.
//! Returns the path of the weights file. Throws `invalid_input` for heads with unset weights and
//! `io_error` when writing fails; either way no file is left half written and nothing is replaced
//! (the files are written under temporary names and renamed into place; directories the call
//! created are removed again).
template <std::size_t H, std::size_t L>
std::filesystem::path save_heads(const std::filesystem::path& dir, const head_stack<H, L>& heads, const head_save_options& opt = {}) {
  namespace fs = std::filesystem;
  heads.validate();
  const std::size_t d = heads.hidden_size(), V = heads.vocab_size(), K = heads.num_heads(), NL = heads.num_layers();
  safetensors_writer w;
  std::list<std::vector<std::byte>> converted;  // stable storage for converted tensors
  std::optional<weight_dtype> seen;
  auto add = [&](const std::string& name, weight_ptr p, std::vector<std::uint64_t> shape) {
    std::size_t n = 1;
    for (auto s : shape) n *= static_cast<std::size_t>(s);
    const weight_dtype out = opt.dtype ? *opt.dtype : p.dtype;
    seen = out;
    std::span<const std::byte> bytes(static_cast<const std::byte*>(p.data), n * dtype_size(p.dtype));
    if (out != p.dtype) {
      auto& buf = converted.emplace_back(n * dtype_size(out));
      detail::convert_weights(bytes.data(), p.dtype, buf.data(), out, n);
      bytes = buf;
    }
    w.add(name, detail::to_safetensors_dtype(out), std::move(shape), bytes);
  };
  const std::string pfx(head_loader::hf_prefix);
  for (std::size_t h = 0; h < K; ++h) {
    for (std::size_t l = 0; l < NL; ++l) {
      const auto blk = heads.resblock(h, l);
      const std::string base = pfx + std::to_string(h) + "." + std::to_string(l) + ".linear.";
      add(base + "weight", blk.weight, {d, d});
      add(base + "bias", blk.bias, {d});
    }
    if (heads.kind() == projection_kind::per_head)
      add(pfx + std::to_string(h) + "." + std::to_string(NL) + ".weight", heads.projection(h), {V, d});
  }
  w.add_metadata("format", "pt");
  std::string cfg;
  if (opt.write_config) {
    const char* torch_dtype = !seen || *seen == weight_dtype::f32 ? "float32" : *seen == weight_dtype::f16 ? "float16" : "bfloat16";
    cfg = "{\n  \"medusa_num_heads\": " + std::to_string(K) + ",\n  \"medusa_num_layers\": " + std::to_string(NL) +
          ",\n  \"hidden_size\": " + std::to_string(d) + ",\n  \"vocab_size\": " + std::to_string(V) +
          ",\n  \"torch_dtype\": \"" + torch_dtype + "\"";
    if (heads.kind() == projection_kind::shared_lm_head) cfg += ",\n  \"version\": \"2\"";
    if (!opt.base_model_name_or_path.empty()) cfg += ",\n  \"base_model_name_or_path\": " + json_quote(opt.base_model_name_or_path);
    cfg += "\n}\n";
  }

  const fs::path path = dir / opt.weights_file, config = dir / "config.json";
  std::error_code ec;
  // The topmost directory this call creates, removed again (when empty) if writing fails.
  fs::path created;
  for (fs::path p = dir; !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    created = p;
    if (p == p.parent_path()) break;
  }
  auto remove_created = [&] {
    if (created.empty()) return;
    for (fs::path p = dir;; p = p.parent_path()) {
      fs::remove(p, ec);  // only empty directories go
      if (p == created || p == p.parent_path()) break;
    }
  };
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir, ec)) {
    remove_created();
    throw io_error("cannot create directory " + dir.string());
  }
  // A directory in a file's place would make a rename fail after the other file was replaced.
  for (const fs::path& target : {path, config})
    if ((target == path || opt.write_config) && fs::is_directory(target, ec)) {
      remove_created();
      throw io_error("cannot write " + target.string() + ": a directory is in the way");
    }
  // config.json goes to a temporary file first, the weights are written (atomically), then the
  // config is renamed over the old one.
  fs::path config_tmp = config;
  config_tmp += ".tmp";
  auto fail = [&](const std::string& what) {
    if (opt.write_config) fs::remove(config_tmp, ec);
    remove_created();
    throw io_error(what);
  };
  if (opt.write_config) {
    std::ofstream out(config_tmp, std::ios::binary | std::ios::trunc);
    if (!out) {
      remove_created();
      throw io_error("cannot create " + config_tmp.string());
    }
    out << cfg;
    out.flush();
    if (!out) {
      out.close();
      fail("cannot write " + config_tmp.string());
    }
  }
  try {
    w.write(path);
  } catch (const io_error& e) {
    fail(std::string(e.what()).substr(8));  // drop "medusa: "
  }
  if (opt.write_config) {
    fs::rename(config_tmp, config, ec);
    if (ec) fail("cannot rename " + config_tmp.string() + " to " + config.string() + ": " + ec.message());
  }
  return path;
}

MEDUSA_NAMESPACE_END
