// shared/common/utf8: what the services accept as text and how they quote what they refuse.
#include "shared/common/utf8.h"

#include <doctest/doctest.h>

#include <string>

using keep::printable;
using keep::utf8_invalid_offset;
using keep::utf8_valid;

TEST_CASE("valid UTF-8 is accepted, every RFC 3629 violation is found at its offset") {
  CHECK(utf8_valid(""));
  CHECK(utf8_valid("plain ASCII, with \t and \n"));
  CHECK(
      utf8_valid("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x8d\x8e \xf4\x8f\xbf\xbf"));  // up to U+10FFFF
  CHECK(utf8_valid(std::string("NUL \0 is a code point", 21)));
  CHECK(utf8_invalid_offset("ab\xff") == 2);            // never a UTF-8 byte
  CHECK(utf8_invalid_offset("a\x80") == 1);             // a lone continuation byte
  CHECK(utf8_invalid_offset("\xc0\xaf") == 0);          // overlong '/'
  CHECK(utf8_invalid_offset("xy\xe0\x80\xaf") == 2);    // overlong, 3 bytes
  CHECK(utf8_invalid_offset("\xed\xa0\x80") == 0);      // a surrogate (U+D800)
  CHECK(utf8_invalid_offset("\xf4\x90\x80\x80") == 0);  // above U+10FFFF
  CHECK(utf8_invalid_offset("ok \xe2\x82") == 3);       // cut short at the end
  CHECK(utf8_invalid_offset("\xc3\xa9\xc3") == 2);      // a complete one, then a cut one
}

TEST_CASE("printable quotes any bytes as ASCII, bounded") {
  CHECK(printable("robot-7") == "robot-7");
  CHECK(printable("a\xff\n\\b") == "a\\xff\\x0a\\x5cb");
  CHECK(printable(std::string(100, 'x'), 8) == "xxxxxxxx...");
  CHECK(utf8_valid(printable("\xed\xa0\x80\xc0")));
}
