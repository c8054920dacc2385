// SPDX-License-Identifier: Apache-2.0
// The strict JSON reader: accepted documents, every strictness rule, quoting round trip.
#include <medusa/io/json.hpp>

#include <doctest/doctest.h>

#include <string>

TEST_CASE("json: parses objects, arrays, numbers, strings and literals") {
  const auto v = medusa::parse_json(R"( {"a": [1, -2.5e3, 0, true, false, null], "s": "x\"\\\/\b\f\n\r\t\u00e9\ud83d\ude00", "o": {}} )");
  REQUIRE(v.is_object());
  CHECK(v.size() == 3);
  CHECK(v.key(0) == "a");
  const auto& a = v.find("a")->as_array();
  REQUIRE(a.size() == 6);
  CHECK(a[0].as_uint64() == 1u);
  CHECK(a[1].as_number() == -2500.0);
  CHECK_FALSE(a[1].as_uint64().has_value());
  CHECK(a[2].as_uint64() == 0u);
  CHECK(a[3].as_bool());
  CHECK_FALSE(a[4].as_bool());
  CHECK(a[5].is_null());
  CHECK(v.find("s")->as_string() == "x\"\\/\b\f\n\r\t\xc3\xa9\xf0\x9f\x98\x80");
  CHECK(v.find("o")->is_object());
  CHECK(v.find("missing") == nullptr);
  CHECK(medusa::parse_json("18446744073709551615").as_uint64() == 18446744073709551615ull);
  CHECK_FALSE(medusa::parse_json("18446744073709551616").as_uint64().has_value());
  CHECK(medusa::parse_json("1e-400").as_number() == 0.0);  // underflow is harmless
  CHECK(medusa::parse_json("\"\xe2\x82\xac\"").as_string() == "\xe2\x82\xac");
  CHECK_THROWS_AS((void)medusa::parse_json("1").as_string(), medusa::invalid_input);
}

TEST_CASE("json: strictness rules each reject with json_error") {
  const char* bad[] = {
      "",                  // empty
      "{",                 // unterminated
      "{\"a\":1,}",        // trailing comma
      "[1,]",              // trailing comma
      "01",                // leading zero
      "-",                 // bare minus
      "1.",                // no fraction digits
      "1e",                // no exponent digits
      "1e400",             // overflow
      "NaN",               // not JSON
      "Infinity",          //
      "// c\n1",           // comment
      "{'a':1}",           // single quotes
      "{\"a\" 1}",         // missing colon
      "{\"a\":1 \"b\":2}", // missing comma
      "{\"a\":1,\"a\":2}", // duplicate key
      "\"a\tb\"",          // raw control character
      "\"\\x\"",           // bad escape
      "\"\\u12\"",         // short \u
      "\"\\ud800\"",       // lone high surrogate
      "\"\\udc00\"",       // lone low surrogate
      "\"\xff\"",          // invalid UTF-8
      "\"\xc0\xaf\"",      // overlong
      "\"\xed\xa0\x80\"",  // encoded surrogate
      "\"\xe2\x82\"",      // truncated sequence
      "1 2",               // trailing data
      "tru",               // bad literal
      "[1] x",             // trailing garbage
  };
  for (const char* s : bad) {
    CAPTURE(s);
    CHECK_THROWS_AS((void)medusa::parse_json(s), medusa::json_error);
  }
  // Nesting is limited instead of overflowing the stack.
  CHECK_NOTHROW((void)medusa::parse_json(std::string(100, '[') + std::string(100, ']')));
  CHECK_THROWS_AS((void)medusa::parse_json(std::string(100000, '[')), medusa::json_error);
}

TEST_CASE("json: error offsets point at the problem") {
  try {
    (void)medusa::parse_json("{\"a\": 1, \"a\": 2}");
    FAIL("expected an error");
  } catch (const medusa::json_error& e) {
    CHECK(e.offset() == 9);
    CHECK(std::string(e.what()).find("duplicate key \"a\"") != std::string::npos);
  }
}

TEST_CASE("json_quote round-trips through the parser") {
  const std::string s = std::string("q\"b\\n\nt\tc") + '\x01' + "\xc3\xa9";
  CHECK(medusa::parse_json(medusa::json_quote(s)).as_string() == s);
  CHECK(medusa::json_quote("a\"b") == "\"a\\\"b\"");
}
