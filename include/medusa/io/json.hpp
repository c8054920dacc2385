// SPDX-License-Identifier: Apache-2.0
//! @file json.hpp
//! A small, strict JSON reader (RFC 8259) and string quoting for writers, standard library only.
//!
//! Used for safetensors headers, `config.json` and `*.index.json`. Strict means: no comments, no
//! trailing commas, no leading zeros, no NaN/Infinity, no control characters in strings, valid
//! UTF-8 and surrogate pairs, finite numbers, duplicate object keys rejected, nesting limited. Every
//! error is a `medusa::json_error` naming the byte offset. Input is never trusted: the parser is
//! fuzzed through the safetensors reader.
//!
//! @code
//! auto v = medusa::parse_json(R"({"medusa_num_heads": 4, "version": "2"})");
//! auto heads = v.find("medusa_num_heads")->as_uint64();   // std::optional<std::uint64_t>{4}
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! Malformed JSON; `offset()` is the byte position where parsing stopped.
class json_error : public invalid_input {
 public:
  //! @param what the problem; @param offset byte position where parsing stopped.
  json_error(const std::string& what, std::size_t offset)
      : invalid_input("JSON error at byte " + std::to_string(offset) + ": " + what), offset_(offset) {}
  //! Byte offset of the problem in the parsed text.
  [[nodiscard]] std::size_t offset() const noexcept { return offset_; }

 private:
  std::size_t offset_;
};

//! One parsed JSON value. Objects keep their members in document order.
class json_value {
 public:
  //! The JSON type of a value.
  enum class kind : std::uint8_t { null, boolean, number, string, array, object };

  json_value() = default;

  //! The JSON type.
  [[nodiscard]] kind type() const noexcept { return kind_; }
  [[nodiscard]] bool is_null() const noexcept { return kind_ == kind::null; }
  [[nodiscard]] bool is_bool() const noexcept { return kind_ == kind::boolean; }
  [[nodiscard]] bool is_number() const noexcept { return kind_ == kind::number; }
  [[nodiscard]] bool is_string() const noexcept { return kind_ == kind::string; }
  [[nodiscard]] bool is_array() const noexcept { return kind_ == kind::array; }
  [[nodiscard]] bool is_object() const noexcept { return kind_ == kind::object; }

  //! The boolean; throws `invalid_input` if this is not a boolean.
  [[nodiscard]] bool as_bool() const {
    expect(kind::boolean);
    return bool_;
  }
  //! The number as a double; throws `invalid_input` if this is not a number.
  [[nodiscard]] double as_number() const {
    expect(kind::number);
    return number_;
  }
  //! The number exactly as a non-negative integer, if it is one written without fraction or
  //! exponent and fits in 64 bits; `std::nullopt` otherwise (also for non-numbers).
  [[nodiscard]] std::optional<std::uint64_t> as_uint64() const noexcept {
    if (kind_ != kind::number || text_.empty() || text_[0] == '-') return std::nullopt;
    if (text_.find_first_of(".eE") != std::string::npos) return std::nullopt;
    std::uint64_t v = 0;
    const auto [ptr, ec] = std::from_chars(text_.data(), text_.data() + text_.size(), v);
    if (ec != std::errc{} || ptr != text_.data() + text_.size()) return std::nullopt;
    return v;
  }
  //! The string (decoded, UTF-8); throws `invalid_input` if this is not a string.
  [[nodiscard]] const std::string& as_string() const {
    expect(kind::string);
    return text_;
  }
  //! The elements; throws `invalid_input` if this is not an array.
  [[nodiscard]] const std::vector<json_value>& as_array() const {
    expect(kind::array);
    return items_;
  }
  //! Number of members of an object / elements of an array, 0 otherwise.
  [[nodiscard]] std::size_t size() const noexcept {
    return kind_ == kind::array || kind_ == kind::object ? items_.size() : 0;
  }
  //! Key of member `i` of an object.
  [[nodiscard]] const std::string& key(std::size_t i) const {
    expect(kind::object);
    return keys_.at(i);
  }
  //! Value of member `i` of an object.
  [[nodiscard]] const json_value& value(std::size_t i) const {
    expect(kind::object);
    return items_.at(i);
  }
  //! The member named `name` of an object, or nullptr (also when this is not an object).
  [[nodiscard]] const json_value* find(std::string_view name) const noexcept {
    if (kind_ != kind::object) return nullptr;
    for (std::size_t i = 0; i < keys_.size(); ++i)
      if (keys_[i] == name) return &items_[i];
    return nullptr;
  }

 private:
  friend class json_parser;
  void expect(kind k) const {
    if (kind_ != k) throw invalid_input("JSON value has the wrong type");
  }
  kind kind_ = kind::null;
  bool bool_ = false;
  double number_ = 0.0;
  std::string text_;               // string value, or the raw text of a number
  std::vector<json_value> items_;  // array elements or object values
  std::vector<std::string> keys_;  // object keys (parallel to items_)
};

//! The strict recursive-descent parser behind `parse_json`.
class json_parser {
 public:
  //! Maximum nesting depth of arrays/objects (deeper input is rejected, not a stack overflow).
  static constexpr int max_depth = 128;

  explicit json_parser(std::string_view text) noexcept : s_(text) {}

  //! Parses the whole text as one value surrounded by optional whitespace.
  json_value parse_document() {
    skip_ws();
    json_value v = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw json_error(what, pos_); }

  void skip_ws() noexcept {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  char peek() const {
    if (pos_ >= s_.size()) fail("unexpected end of input");
    return s_[pos_];
  }
  void expect_literal(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) != lit) fail("invalid literal");
    pos_ += lit.size();
  }

  json_value parse_value(int depth) {
    json_value v;
    const char c = peek();
    switch (c) {
      case '{': parse_object(v, depth); break;
      case '[': parse_array(v, depth); break;
      case '"':
        v.kind_ = json_value::kind::string;
        v.text_ = parse_string();
        break;
      case 't': expect_literal("true"); v.kind_ = json_value::kind::boolean; v.bool_ = true; break;
      case 'f': expect_literal("false"); v.kind_ = json_value::kind::boolean; break;
      case 'n': expect_literal("null"); break;
      default:
        if (c == '-' || (c >= '0' && c <= '9')) {
          parse_number(v);
        } else {
          fail(std::string("unexpected character '") + (c >= 0x20 && c < 0x7f ? std::string(1, c) : "?") + "'");
        }
    }
    return v;
  }

  void parse_object(json_value& v, int depth) {
    if (depth >= max_depth) fail("nesting deeper than " + std::to_string(max_depth));
    v.kind_ = json_value::kind::object;
    ++pos_;  // '{'
    skip_ws();
    if (peek() == '}') {
      ++pos_;
      return;
    }
    for (;;) {
      skip_ws();
      if (peek() != '"') fail("expected a string key");
      const std::size_t key_pos = pos_;
      std::string key = parse_string();
      for (const auto& k : v.keys_)
        if (k == key) throw json_error("duplicate key \"" + key + "\"", key_pos);
      skip_ws();
      if (peek() != ':') fail("expected ':'");
      ++pos_;
      skip_ws();
      v.items_.push_back(parse_value(depth + 1));
      v.keys_.push_back(std::move(key));
      skip_ws();
      const char c = peek();
      ++pos_;
      if (c == '}') return;
      if (c != ',') {
        --pos_;
        fail("expected ',' or '}'");
      }
    }
  }

  void parse_array(json_value& v, int depth) {
    if (depth >= max_depth) fail("nesting deeper than " + std::to_string(max_depth));
    v.kind_ = json_value::kind::array;
    ++pos_;  // '['
    skip_ws();
    if (peek() == ']') {
      ++pos_;
      return;
    }
    for (;;) {
      skip_ws();
      v.items_.push_back(parse_value(depth + 1));
      skip_ws();
      const char c = peek();
      ++pos_;
      if (c == ']') return;
      if (c != ',') {
        --pos_;
        fail("expected ',' or ']'");
      }
    }
  }

  void parse_number(json_value& v) {
    const std::size_t begin = pos_;
    auto digit = [&] { return pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9'; };
    if (s_[pos_] == '-') ++pos_;
    if (!digit()) fail("expected a digit");
    if (s_[pos_] == '0') {
      ++pos_;
      if (digit()) fail("leading zeros are not allowed");
    } else {
      while (digit()) ++pos_;
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (!digit()) fail("expected a digit after '.'");
      while (digit()) ++pos_;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (!digit()) fail("expected a digit in the exponent");
      while (digit()) ++pos_;
    }
    v.kind_ = json_value::kind::number;
    v.text_.assign(s_.substr(begin, pos_ - begin));
    double d = 0.0;
    const auto [ptr, ec] = std::from_chars(v.text_.data(), v.text_.data() + v.text_.size(), d);
    // from_chars reports out-of-range for overflow (and for underflow, which is harmless).
    if (ptr != v.text_.data() + v.text_.size()) throw json_error("invalid number", begin);
    if (ec == std::errc::result_out_of_range) {
      // Only a negative exponent can underflow; anything else overflowed.
      if (v.text_.find("e-") == std::string::npos && v.text_.find("E-") == std::string::npos)
        throw json_error("number out of range: " + v.text_, begin);
      d = 0.0;
    } else if (ec != std::errc{} || !std::isfinite(d)) {
      throw json_error("number out of range: " + v.text_, begin);
    }
    v.number_ = d;
  }

  unsigned hex4() {
    if (s_.size() - pos_ < 4) fail("truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<unsigned>(c - 'A' + 10);
      else fail("invalid hex digit in \\u escape");
    }
    return v;
  }

  static void append_utf8(std::string& out, std::uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  // Validates one UTF-8 sequence starting at pos_ (first byte >= 0x80) and copies it.
  void copy_utf8(std::string& out) {
    const auto b0 = static_cast<unsigned char>(s_[pos_]);
    int len = 0;
    std::uint32_t cp = 0;
    if (b0 >= 0xc2 && b0 <= 0xdf) { len = 2; cp = b0 & 0x1fu; }
    else if (b0 >= 0xe0 && b0 <= 0xef) { len = 3; cp = b0 & 0x0fu; }
    else if (b0 >= 0xf0 && b0 <= 0xf4) { len = 4; cp = b0 & 0x07u; }
    else fail("invalid UTF-8");
    if (s_.size() - pos_ < static_cast<std::size_t>(len)) fail("truncated UTF-8 sequence");
    for (int i = 1; i < len; ++i) {
      const auto b = static_cast<unsigned char>(s_[pos_ + static_cast<std::size_t>(i)]);
      if ((b & 0xc0u) != 0x80u) fail("invalid UTF-8");
      cp = (cp << 6) | (b & 0x3fu);
    }
    // Reject overlong forms, surrogates and code points past U+10FFFF.
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
        (cp >= 0xd800 && cp <= 0xdfff))
      fail("invalid UTF-8");
    out.append(s_.substr(pos_, static_cast<std::size_t>(len)));
    pos_ += static_cast<std::size_t>(len);
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    for (;;) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const auto c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) fail("control character in string");
      if (c >= 0x80) {
        copy_utf8(out);
        continue;
      }
      if (c != '\\') {
        out += static_cast<char>(c);
        ++pos_;
        continue;
      }
      ++pos_;
      if (pos_ >= s_.size()) fail("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t cp = hex4();
          if (cp >= 0xdc00 && cp <= 0xdfff) fail("unpaired low surrogate");
          if (cp >= 0xd800 && cp <= 0xdbff) {
            if (s_.size() - pos_ < 2 || s_[pos_] != '\\' || s_[pos_ + 1] != 'u') fail("unpaired high surrogate");
            pos_ += 2;
            const std::uint32_t lo = hex4();
            if (lo < 0xdc00 || lo > 0xdfff) fail("invalid low surrogate");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          }
          append_utf8(out, cp);
          break;
        }
        default: --pos_; fail("invalid escape");
      }
    }
  }

  std::string_view s_;
  std::size_t pos_ = 0;
};

//! Parses `text` as one strict JSON document; throws `json_error` on any deviation.
inline json_value parse_json(std::string_view text) { return json_parser(text).parse_document(); }

//! Returns `text` as a JSON string literal (quotes included), escaping `"`, `\` and control bytes.
inline std::string json_quote(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  out += '"';
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          constexpr char hex[] = "0123456789abcdef";
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
  return out;
}

MEDUSA_NAMESPACE_END
