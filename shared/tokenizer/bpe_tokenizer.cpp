#include "shared/tokenizer/bpe_tokenizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>

#include "shared/common/json_limits.h"

namespace keep::tok {
namespace {

// ---- byte-level alphabet (GPT-2 bytes_to_unicode) -----------------------------------------------

// Printable bytes map to themselves as code points; the other 68 map to U+0100.. in byte order.
struct ByteAlphabet {
  std::array<uint32_t, 256> byte_to_cp{};
  std::array<std::string, 256> byte_to_utf8;
  std::array<int16_t, 512> cp_to_byte{};  // -1 when the code point is not in the alphabet

  ByteAlphabet() {
    cp_to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      byte_to_cp[b] = printable ? static_cast<uint32_t>(b) : next++;
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
      utf8proc_uint8_t buf[4];
      const auto len = utf8proc_encode_char(static_cast<utf8proc_int32_t>(byte_to_cp[b]), buf);
      byte_to_utf8[b].assign(reinterpret_cast<const char*>(buf), static_cast<size_t>(len));
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet kAlphabet;
  return kAlphabet;
}

// "Ġthe" -> " the". A token with a character outside the alphabet decodes to its own UTF-8 bytes
// (HF's ByteLevel decoder does the same).
std::string token_text_to_bytes(std::string_view token) {
  std::string out;
  out.reserve(token.size());
  for (size_t pos = 0; pos < token.size();) {
    uint32_t cp;
    pos += static_cast<size_t>(decode_utf8(token, pos, &cp));
    if (cp >= 512 || alphabet().cp_to_byte[cp] < 0) return std::string(token);
    out.push_back(static_cast<char>(alphabet().cp_to_byte[cp]));
  }
  return out;
}

std::string bytes_to_token_text(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += alphabet().byte_to_utf8[static_cast<uint8_t>(c)];
  return out;
}

bool is_ascii(std::string_view s) {
  for (char c : s) {
    if (static_cast<uint8_t>(c) >= 0x80) return false;
  }
  return true;
}

bool is_whitespace_cp(uint32_t cp) {
  return cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

bool is_word_cp(uint32_t cp) {
  if (cp == kInvalidCodePoint) return false;
  if (cp < 0x80) return std::isalnum(static_cast<int>(cp)) != 0;
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
         (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO);
}

// The code point that ends just before `end` (for lstrip / single_word).
uint32_t cp_before(std::string_view text, size_t end, size_t* start) {
  size_t s = end - 1;
  for (int k = 0; k < 3 && s > 0 && (static_cast<uint8_t>(text[s]) & 0xC0) == 0x80; ++k) --s;
  uint32_t cp;
  const int len = decode_utf8(text, s, &cp);
  if (s + static_cast<size_t>(len) != end) {  // not a whole sequence: the last byte alone
    s = end - 1;
    cp = kInvalidCodePoint;
  }
  *start = s;
  return cp;
}

// ---- normalization ------------------------------------------------------------------------------

int utf8proc_options(Normalization n) {
  switch (n) {
    case Normalization::kNfc:
      return UTF8PROC_STABLE | UTF8PROC_COMPOSE;
    case Normalization::kNfkc:
      return UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
    case Normalization::kNfd:
      return UTF8PROC_STABLE | UTF8PROC_DECOMPOSE;
    case Normalization::kNfkd:
      return UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
    case Normalization::kNone:
      break;
  }
  return 0;
}

// Code points that every normalization form leaves unchanged and that never combine with a
// neighbour they are not already next to: below U+0300 (before the combining marks), Cyrillic
// letters, Arabic letters, kana, CJK unified ideographs, Hangul syllables, the emoji blocks. A
// composition's second character (a combining mark, a jamo V/T, a kana voicing mark) is never in
// this set, so a run made only of these is its own normal form. (NFKC/NFKD also map some of these
// ranges, e.g. U+00A0, and NFD decomposes many of them, so the shortcut is for NFC only.)
bool is_quick_stable(uint32_t cp) {
  return cp < 0x300 || (cp >= 0x400 && cp <= 0x482) || (cp >= 0x600 && cp <= 0x64A) ||
         (cp >= 0x3041 && cp <= 0x3096) || (cp >= 0x30A1 && cp <= 0x30FA) ||
         (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0xAC00 && cp <= 0xD7A3) ||
         (cp >= 0x1F300 && cp <= 0x1FAFF);
}

void append_normalized(std::string_view run, utf8proc_option_t options, std::string* out) {
  utf8proc_uint8_t* buf = nullptr;
  const auto len = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(run.data()),
                                static_cast<utf8proc_ssize_t>(run.size()), &buf, options);
  if (len >= 0 && buf != nullptr) {
    out->append(reinterpret_cast<const char*>(buf), static_cast<size_t>(len));
  } else {
    out->append(run);  // cannot happen on well-formed UTF-8
  }
  std::free(buf);
}

// Normalizes `text`; invalid bytes pass through unchanged and split the text into runs normalized
// separately. ASCII never composes with what precedes it, so runs end before an ASCII byte; ASCII
// and runs of quick-stable code points are copied, the other runs go through utf8proc. Returns
// `text` itself when it is ASCII (or there is no normalizer).
std::string_view normalize(std::string_view text, Normalization n, std::string* storage) {
  if (n == Normalization::kNone || is_ascii(text)) return text;
  const bool quick = n == Normalization::kNfc;
  const auto options = static_cast<utf8proc_option_t>(utf8proc_options(n));
  storage->clear();
  storage->reserve(text.size() + 16);
  size_t pos = 0;
  while (pos < text.size()) {
    // ASCII is copied, except the last ASCII byte before non-ASCII text: it may compose with it.
    size_t ascii_end = pos;
    while (ascii_end < text.size() && static_cast<uint8_t>(text[ascii_end]) < 0x80) ++ascii_end;
    if (ascii_end == text.size()) {
      storage->append(text.substr(pos));
      break;
    }
    if (ascii_end > pos + 1) {
      storage->append(text.substr(pos, ascii_end - 1 - pos));
      pos = ascii_end - 1;
    }
    // A run: at most one leading ASCII byte, then non-ASCII well-formed code points.
    size_t end = pos;
    bool stable = true;
    bool invalid = false;
    while (end < text.size()) {
      const auto b = static_cast<uint8_t>(text[end]);
      if (b < 0x80 && end > pos) break;
      uint32_t cp;
      const int len = decode_utf8(text, end, &cp);
      if (cp == kInvalidCodePoint) {
        invalid = end == pos;  // an invalid byte is a run of its own
        if (invalid) ++end;
        break;
      }
      if (!(quick && is_quick_stable(cp)) && b >= 0x80) stable = false;
      end += static_cast<size_t>(len);
    }
    const std::string_view run = text.substr(pos, end - pos);
    if (invalid || stable) {
      storage->append(run);
    } else {
      append_normalized(run, options, storage);
    }
    pos = end;
  }
  return *storage;
}

// ---- added tokens -------------------------------------------------------------------------------

// Leftmost-longest matching of a set of added tokens. Candidates are bucketed by first byte,
// longest first.
class AddedTokenMatcher {
 public:
  void build(const std::vector<AddedToken>& tokens, bool normalized) {
    for (auto& b : by_first_byte_) b.clear();
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i].normalized != normalized || tokens[i].content.empty()) continue;
      by_first_byte_[static_cast<uint8_t>(tokens[i].content[0])].push_back(i);
    }
    for (auto& b : by_first_byte_) {
      std::stable_sort(b.begin(), b.end(), [&](size_t x, size_t y) {
        return tokens[x].content.size() > tokens[y].content.size();
      });
    }
    tokens_ = &tokens;
  }

  bool empty() const {
    for (const auto& b : by_first_byte_) {
      if (!b.empty()) return false;
    }
    return true;
  }

  // Calls on_text(span) for text between matches and on_token(id) for each match.
  template <typename OnText, typename OnToken>
  void split(std::string_view text, bool parse_special, OnText&& on_text,
             OnToken&& on_token) const {
    size_t done = 0;  // text before `done` has been emitted
    for (size_t pos = 0; pos < text.size(); ++pos) {
      const auto& cands = by_first_byte_[static_cast<uint8_t>(text[pos])];
      if (cands.empty()) continue;
      for (size_t idx : cands) {
        const AddedToken& t = (*tokens_)[idx];
        if (!parse_special && t.special) continue;
        if (text.compare(pos, t.content.size(), t.content) != 0) continue;
        size_t start = pos, stop = pos + t.content.size();
        if (t.single_word && !at_word_boundary(text, start, stop)) continue;
        if (t.lstrip) {
          while (start > done) {
            size_t s;
            if (!is_whitespace_cp(cp_before(text, start, &s))) break;
            start = s;
          }
        }
        if (t.rstrip) {
          while (stop < text.size()) {
            uint32_t cp;
            const int len = decode_utf8(text, stop, &cp);
            if (!is_whitespace_cp(cp)) break;
            stop += static_cast<size_t>(len);
          }
        }
        if (start > done) on_text(text.substr(done, start - done));
        on_token(t.id);
        done = stop;
        pos = stop - 1;
        break;
      }
    }
    if (done < text.size()) on_text(text.substr(done));
  }

 private:
  static bool at_word_boundary(std::string_view text, size_t start, size_t stop) {
    size_t s;
    if (start > 0 && is_word_cp(cp_before(text, start, &s))) return false;
    if (stop < text.size()) {
      uint32_t cp;
      decode_utf8(text, stop, &cp);
      if (is_word_cp(cp)) return false;
    }
    return true;
  }

  std::array<std::vector<size_t>, 256> by_first_byte_;
  const std::vector<AddedToken>* tokens_ = nullptr;
};

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

struct Merge {
  int32_t rank;
  int32_t id;
};

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

class Fnv64 {
 public:
  void add(std::string_view s) {
    for (char c : s) byte(static_cast<uint8_t>(c));
    byte(0xFF);  // separator: no ambiguity between ("ab","c") and ("a","bc")
  }
  void add(int64_t v) {
    for (int i = 0; i < 8; ++i) byte(static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i)));
  }
  uint64_t value() const { return h_; }

 private:
  void byte(uint8_t b) {
    h_ ^= b;
    h_ *= 0x100000001B3ull;
  }
  uint64_t h_ = 0xCBF29CE484222325ull;
};

// Pieces of at most this many bytes are cached; the cache is cleared when it reaches kCacheMax.
constexpr size_t kCacheMaxPiece = 128;
constexpr size_t kCacheMax = 1 << 16;
// Pieces of more symbols than this merge with a heap (n log n) instead of the quadratic scan.
constexpr size_t kHeapThreshold = 48;

}  // namespace

// ---- the tokenizer ------------------------------------------------------------------------------

struct BpeTokenizer::Impl {
  BpeOptions options;
  PreTokenizer pre;
  std::vector<std::string> id_to_token;  // "" for ids that exist nowhere
  std::vector<std::string> id_to_bytes;
  std::vector<uint8_t> id_kind;  // kNone / kVocab / kAdded / kSpecial
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> token_to_id;
  std::unordered_map<uint64_t, Merge> merges;
  std::array<int32_t, 256> byte_ids{};  // -1 when the byte's token is missing
  std::vector<AddedToken> added;
  AddedTokenMatcher raw_matcher, normalized_matcher;
  uint64_t fingerprint = 0;

  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache;

  static constexpr uint8_t kNone = 0, kVocab = 1, kAdded = 2, kSpecial = 3;

  // BPE of one piece of raw bytes; appends ids to *out.
  void bpe(std::string_view piece, std::vector<int32_t>* out) const {
    if (piece.size() == 1) {
      if (const int32_t id = byte_ids[static_cast<uint8_t>(piece[0])]; id >= 0) out->push_back(id);
      return;
    }
    const bool cacheable = piece.size() <= kCacheMaxPiece;
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mu);
      if (auto it = cache.find(piece); it != cache.end()) {
        out->insert(out->end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const size_t begin = out->size();
    bpe_uncached(piece, out);
    if (cacheable) {
      std::vector<int32_t> ids(out->begin() + static_cast<std::ptrdiff_t>(begin), out->end());
      std::lock_guard<std::mutex> lock(cache_mu);
      if (cache.size() >= kCacheMax) cache.clear();
      cache.emplace(std::string(piece), std::move(ids));
    }
  }

  const Merge* find_merge(int32_t a, int32_t b) const {
    const auto it = merges.find(pair_key(a, b));
    return it == merges.end() ? nullptr : &it->second;
  }

  void bpe_uncached(std::string_view piece, std::vector<int32_t>* out) const {
    if (options.ignore_merges) {
      if (auto it = token_to_id.find(bytes_to_token_text(piece)); it != token_to_id.end()) {
        out->push_back(it->second);
        return;
      }
    }
    std::vector<int32_t> syms;
    syms.reserve(piece.size());
    for (char c : piece) {
      const int32_t id = byte_ids[static_cast<uint8_t>(c)];
      if (id >= 0) syms.push_back(id);  // a byte without a token (and no unk) is dropped, as in HF
    }
    if (syms.size() > kHeapThreshold) {
      merge_with_heap(&syms);
    } else {
      merge_by_scan(&syms);
    }
    out->insert(out->end(), syms.begin(), syms.end());
  }

  // Short pieces: repeatedly merge the lowest-ranked adjacent pair (leftmost on ties).
  void merge_by_scan(std::vector<int32_t>* syms) const {
    std::vector<Merge> pairs(syms->size() > 1 ? syms->size() - 1 : 0);
    const auto lookup = [&](size_t i) {
      const Merge* m = find_merge((*syms)[i], (*syms)[i + 1]);
      pairs[i] = m ? *m : Merge{INT32_MAX, -1};
    };
    for (size_t i = 0; i < pairs.size(); ++i) lookup(i);
    while (!pairs.empty()) {
      size_t best = 0;
      for (size_t i = 1; i < pairs.size(); ++i) {
        if (pairs[i].rank < pairs[best].rank) best = i;
      }
      if (pairs[best].id < 0) break;
      (*syms)[best] = pairs[best].id;
      syms->erase(syms->begin() + static_cast<std::ptrdiff_t>(best) + 1);
      pairs.erase(pairs.begin() + static_cast<std::ptrdiff_t>(best));
      if (best < pairs.size()) lookup(best);
      if (best > 0) lookup(best - 1);
    }
  }

  // Long pieces: the same order of merges with a priority queue over a linked list of symbols.
  void merge_with_heap(std::vector<int32_t>* syms) const {
    const size_t n = syms->size();
    std::vector<int32_t>& id = *syms;
    std::vector<int32_t> prev(n), next(n);
    std::vector<bool> alive(n, true);
    for (size_t i = 0; i < n; ++i) {
      prev[i] = static_cast<int32_t>(i) - 1;
      next[i] = i + 1 < n ? static_cast<int32_t>(i + 1) : -1;
    }
    struct Cand {
      int32_t rank, left, right, right_id, merged;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    const auto push = [&](int32_t left) {
      if (left < 0 || next[left] < 0) return;
      const int32_t right = next[left];
      if (const Merge* m = find_merge(id[left], id[right])) {
        heap.push({m->rank, left, right, id[right], m->id});
      }
    };
    for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      // Stale when either side was merged away or changed since the candidate was pushed.
      if (!alive[c.left] || !alive[c.right] || next[c.left] != c.right ||
          id[c.right] != c.right_id) {
        continue;
      }
      if (const Merge* m = find_merge(id[c.left], id[c.right]); !m || m->id != c.merged) continue;
      id[c.left] = c.merged;
      alive[c.right] = false;
      next[c.left] = next[c.right];
      if (next[c.right] >= 0) prev[next[c.right]] = c.left;
      push(prev[c.left]);
      push(c.left);
    }
    size_t w = 0;
    for (size_t i = 0; i < n; ++i) {
      if (alive[i]) id[w++] = id[i];
    }
    id.resize(w);
  }

  // The whole pipeline (see the header); appends the ids to *out.
  void encode_into(std::string_view text, bool add_special, bool parse_special,
                   std::vector<int32_t>* out) const {
    if (add_special) out->insert(out->end(), options.prefix_ids.begin(), options.prefix_ids.end());
    std::vector<std::string_view> pieces;
    std::string storage;
    const auto on_normalized_text = [&](std::string_view span) {
      pieces.clear();
      pre.split(span, &pieces);
      for (std::string_view p : pieces) bpe(p, out);
    };
    const auto on_token = [&](int32_t id) { out->push_back(id); };
    const auto on_raw_text = [&](std::string_view span) {
      const std::string_view norm = normalize(span, options.normalization, &storage);
      if (normalized_matcher.empty()) {
        on_normalized_text(norm);
      } else {
        normalized_matcher.split(norm, parse_special, on_normalized_text, on_token);
      }
    };
    raw_matcher.split(text, parse_special, on_raw_text, on_token);
    if (add_special) out->insert(out->end(), options.suffix_ids.begin(), options.suffix_ids.end());
  }
};

BpeTokenizer::BpeTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

Result<BpeTokenizer> BpeTokenizer::from_vocab_and_merges(
    std::vector<std::string> tokens, const std::vector<std::pair<std::string, std::string>>& merges,
    std::vector<AddedToken> added_tokens, BpeOptions options) {
  auto impl = std::make_unique<Impl>();
  KEEP_ASSIGN_OR_RETURN(impl->pre, PreTokenizer::by_name(options.pre_tokenizer));
  impl->options = std::move(options);
  Fnv64 fp;
  fp.add(std::string_view(impl->pre.name()));
  fp.add(static_cast<int64_t>(impl->options.normalization));
  fp.add(static_cast<int64_t>(impl->options.ignore_merges));

  // Vocabulary. A duplicated token text keeps its first id.
  if (tokens.size() > static_cast<size_t>(kMaxTokenIds)) {
    return Status(Code::kInvalidArgument, std::to_string(tokens.size()) + " tokens, more than " +
                                              std::to_string(kMaxTokenIds));
  }
  int32_t size = static_cast<int32_t>(tokens.size());
  for (const AddedToken& t : added_tokens) {
    // The ids size the tables: a huge one would allocate gigabytes for one token.
    if (t.id < 0 || t.id >= kMaxTokenIds) {
      return Status(Code::kInvalidArgument, "added token '" + t.content + "' has id " +
                                                std::to_string(t.id) + " outside [0, " +
                                                std::to_string(kMaxTokenIds) + ")");
    }
    if (t.content.empty()) {
      return Status(Code::kInvalidArgument,
                    "added token " + std::to_string(t.id) + " has empty content");
    }
    size = std::max(size, t.id + 1);
  }
  impl->id_to_token = std::move(tokens);
  impl->id_to_token.resize(static_cast<size_t>(size));
  impl->id_kind.assign(static_cast<size_t>(size), Impl::kNone);
  impl->id_to_bytes.resize(static_cast<size_t>(size));
  impl->token_to_id.reserve(static_cast<size_t>(size));
  for (int32_t id = 0; id < size; ++id) {
    const std::string& text = impl->id_to_token[static_cast<size_t>(id)];
    fp.add(text);
    if (text.empty()) continue;
    impl->id_kind[static_cast<size_t>(id)] = Impl::kVocab;
    impl->id_to_bytes[static_cast<size_t>(id)] = token_text_to_bytes(text);
    impl->token_to_id.emplace(text, id);
  }
  for (const AddedToken& t : added_tokens) {
    const auto i = static_cast<size_t>(t.id);
    impl->id_to_token[i] = t.content;
    impl->id_to_bytes[i] = t.content;
    impl->id_kind[i] = t.special ? Impl::kSpecial : Impl::kAdded;
    impl->token_to_id[t.content] = t.id;
    fp.add(t.content);
    fp.add(t.id);
    fp.add((t.special ? 1 : 0) | (t.lstrip ? 2 : 0) | (t.rstrip ? 4 : 0) | (t.single_word ? 8 : 0) |
           (t.normalized ? 16 : 0));
  }
  impl->added = std::move(added_tokens);
  impl->raw_matcher.build(impl->added, /*normalized=*/false);
  impl->normalized_matcher.build(impl->added, /*normalized=*/true);

  // Merges, ranked by position.
  impl->merges.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const auto ia = impl->token_to_id.find(a);
    const auto ib = impl->token_to_id.find(b);
    const auto iab = impl->token_to_id.find(a + b);
    if (ia == impl->token_to_id.end() || ib == impl->token_to_id.end() ||
        iab == impl->token_to_id.end()) {
      return Status(Code::kInvalidArgument, "merge " + std::to_string(rank) + " '" + a + " " + b +
                                                "' uses a token that is not in the vocabulary");
    }
    impl->merges.emplace(pair_key(ia->second, ib->second),
                         Merge{static_cast<int32_t>(rank), iab->second});
    fp.add(a);
    fp.add(b);
  }

  // The 256 single-byte tokens.
  for (int b = 0; b < 256; ++b) {
    const auto it = impl->token_to_id.find(alphabet().byte_to_utf8[b]);
    impl->byte_ids[b] = it == impl->token_to_id.end() ? -1 : it->second;
  }
  for (const auto& ids : {impl->options.prefix_ids, impl->options.suffix_ids}) {
    for (int32_t id : ids) {
      if (id < 0 || id >= size) {
        return Status(Code::kInvalidArgument,
                      "post-processor id " + std::to_string(id) + " is not in the vocabulary");
      }
      fp.add(id);
    }
  }
  impl->fingerprint = fp.value();
  return BpeTokenizer(std::move(impl));
}

// ---- tokenizer.json -----------------------------------------------------------------------------

namespace {

constexpr std::string_view kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

using nlohmann::json;

bool is_null_or_missing(const json& j, const char* key) {
  return !j.contains(key) || j.at(key).is_null();
}

std::string type_of(const json& j) {
  return j.is_object() && j.contains("type") ? j.at("type").get<std::string>() : std::string();
}

Status unsupported(const std::string& what, const json& j) {
  std::string dump = j.dump();
  if (dump.size() > 200) dump = dump.substr(0, 200) + "...";
  return Status(Code::kInvalidArgument, "unsupported " + what + ": " + dump);
}

Status check_byte_level(const json& j, bool want_regex, const char* where) {
  if (j.value("add_prefix_space", false)) {
    return unsupported(std::string(where) + " (add_prefix_space)", j);
  }
  if (j.value("use_regex", true) != want_regex) {
    return unsupported(std::string(where) + " (use_regex)", j);
  }
  return Status::ok();
}

// Maps the tokenizer.json pre_tokenizer to a PreTokenizer name.
Result<std::string> parse_pre_tokenizer(const json& j) {
  const std::string type = type_of(j);
  if (type == "ByteLevel") {
    KEEP_RETURN_IF_ERROR(check_byte_level(j, true, "pre_tokenizer"));
    return std::string("gpt2");
  }
  if (type != "Sequence" || !j.contains("pretokenizers") || j.at("pretokenizers").size() != 2) {
    return unsupported("pre_tokenizer", j);
  }
  const json& first = j.at("pretokenizers")[0];
  const json& second = j.at("pretokenizers")[1];
  if (type_of(second) != "ByteLevel") return unsupported("pre_tokenizer", j);
  if (type_of(first) == "Digits" && first.value("individual_digits", false)) {
    KEEP_RETURN_IF_ERROR(check_byte_level(second, true, "pre_tokenizer"));
    return std::string("smollm");
  }
  if (type_of(first) == "Split" && first.contains("pattern") &&
      first.at("pattern").contains("Regex") && first.value("behavior", "") == "Isolated" &&
      !first.value("invert", false)) {
    KEEP_RETURN_IF_ERROR(check_byte_level(second, false, "pre_tokenizer"));
    const std::string pattern = first.at("pattern").at("Regex").get<std::string>();
    if (pattern == kQwen2Pattern) return std::string("qwen2");
    if (pattern == kLlama3Pattern) return std::string("llama3");
  }
  return unsupported("pre_tokenizer", j);
}

Result<Normalization> parse_normalizer(const json& j) {
  if (j.is_null()) return Normalization::kNone;
  const std::string type = type_of(j);
  if (type == "NFC") return Normalization::kNfc;
  if (type == "NFKC") return Normalization::kNfkc;
  if (type == "NFD") return Normalization::kNfd;
  if (type == "NFKD") return Normalization::kNfkd;
  if (type == "Sequence" && j.contains("normalizers")) {
    const json& list = j.at("normalizers");
    if (list.empty()) return Normalization::kNone;
    if (list.size() == 1) return parse_normalizer(list[0]);
  }
  return unsupported("normalizer", j);
}

// TemplateProcessing "single": special tokens before $A are the prefix, after it the suffix.
Status parse_post_processor(const json& j, BpeOptions* options) {
  if (j.is_null()) return Status::ok();
  const std::string type = type_of(j);
  if (type == "ByteLevel") return Status::ok();
  if (type == "Sequence" && j.contains("processors")) {
    for (const json& p : j.at("processors")) KEEP_RETURN_IF_ERROR(parse_post_processor(p, options));
    return Status::ok();
  }
  if (type != "TemplateProcessing") return unsupported("post_processor", j);
  bool seen_sequence = false;
  for (const json& item : j.at("single")) {
    if (item.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    if (!item.contains("SpecialToken")) return unsupported("post_processor item", item);
    const std::string name = item.at("SpecialToken").at("id").get<std::string>();
    const json& st = j.at("special_tokens").at(name);
    for (const json& id : st.at("ids")) {
      const std::optional<int64_t> v = json_int64(id);
      if (!v || *v < 0 || *v >= kMaxTokenIds) return unsupported("post_processor id", id);
      (seen_sequence ? options->suffix_ids : options->prefix_ids)
          .push_back(static_cast<int32_t>(*v));
    }
  }
  return Status::ok();
}

Result<BpeTokenizer> parse_tokenizer_json(const json& root) {
  const json& model = root.at("model");
  if (model.contains("type") && model.at("type") != "BPE") return unsupported("model", model);
  if (!is_null_or_missing(model, "dropout") && model.at("dropout").get<double>() > 0) {
    return unsupported("model (dropout)", model.at("dropout"));
  }
  if (!model.value("continuing_subword_prefix", json("")).is_null() &&
      !model.value("continuing_subword_prefix", std::string()).empty()) {
    return unsupported("model (continuing_subword_prefix)", model.at("continuing_subword_prefix"));
  }
  if (!model.value("end_of_word_suffix", json("")).is_null() &&
      !model.value("end_of_word_suffix", std::string()).empty()) {
    return unsupported("model (end_of_word_suffix)", model.at("end_of_word_suffix"));
  }
  if (model.value("byte_fallback", false)) return unsupported("model (byte_fallback)", model);

  BpeOptions options;
  options.ignore_merges = model.value("ignore_merges", false);
  KEEP_ASSIGN_OR_RETURN(options.normalization,
                        parse_normalizer(root.value("normalizer", json(nullptr))));
  KEEP_ASSIGN_OR_RETURN(options.pre_tokenizer,
                        parse_pre_tokenizer(root.value("pre_tokenizer", json(nullptr))));
  const json decoder = root.value("decoder", json(nullptr));
  if (!decoder.is_null() && type_of(decoder) != "ByteLevel") return unsupported("decoder", decoder);
  KEEP_RETURN_IF_ERROR(parse_post_processor(root.value("post_processor", json(nullptr)), &options));

  std::vector<std::string> tokens;
  for (const auto& [text, id_json] : model.at("vocab").items()) {
    const int64_t id = json_int64(id_json).value_or(-1);
    if (id < 0 || id >= kMaxTokenIds) {
      return Status(Code::kInvalidArgument, "vocab id out of range for '" + text + "'");
    }
    if (static_cast<size_t>(id) >= tokens.size()) tokens.resize(static_cast<size_t>(id) + 1);
    tokens[static_cast<size_t>(id)] = text;
  }

  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(model.at("merges").size());
  for (const json& m : model.at("merges")) {
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        return Status(Code::kMalformed, "merge '" + s + "' is not two tokens separated by a space");
      }
      merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else if (m.is_array() && m.size() == 2) {
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      return Status(Code::kMalformed, "merge is neither \"a b\" nor [a, b]: " + m.dump());
    }
  }

  std::vector<AddedToken> added;
  for (const json& a : root.value("added_tokens", json::array())) {
    AddedToken t;
    const std::optional<int64_t> id = json_int64(a.at("id"));
    if (!id || *id < 0 || *id >= kMaxTokenIds) {
      return Status(Code::kInvalidArgument, "added token id " + a.at("id").dump() +
                                                " outside [0, " + std::to_string(kMaxTokenIds) +
                                                ")");
    }
    t.id = static_cast<int32_t>(*id);
    t.content = a.at("content").get<std::string>();
    t.special = a.value("special", false);
    t.lstrip = a.value("lstrip", false);
    t.rstrip = a.value("rstrip", false);
    t.single_word = a.value("single_word", false);
    t.normalized = a.value("normalized", !t.special);
    added.push_back(std::move(t));
  }
  for (const AddedToken& t : added) {
    if (t.content == "<|endoftext|>" || t.content == "<|end_of_text|>") options.eos_id = t.id;
    if (t.content == "<|begin_of_text|>" || t.content == "<s>") options.bos_id = t.id;
  }
  return BpeTokenizer::from_vocab_and_merges(std::move(tokens), merges, std::move(added),
                                             std::move(options));
}

}  // namespace

Result<BpeTokenizer> BpeTokenizer::from_json_string(std::string_view text) {
  if (json_nesting_exceeds(text)) {
    return Status(Code::kMalformed, "tokenizer.json: nested deeper than " +
                                        std::to_string(kMaxJsonDepth) + " levels");
  }
  const json root = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return Status(Code::kMalformed, "tokenizer.json: not a JSON object");
  }
  try {
    auto r = parse_tokenizer_json(root);
    if (!r.is_ok()) return r.status().with_context("tokenizer.json");
    return r;
  } catch (const json::exception& e) {
    return Status(Code::kMalformed, std::string("tokenizer.json: ") + e.what());
  }
}

Result<BpeTokenizer> BpeTokenizer::from_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(Code::kIoError, "cannot open tokenizer file " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status(Code::kIoError, "cannot read tokenizer file " + path);
  auto r = from_json_string(ss.str());
  if (!r.is_ok()) return r.status().with_context(path);
  return r;
}

// ---- queries ------------------------------------------------------------------------------------

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, bool add_special,
                                          bool parse_special) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  impl_->encode_into(text, add_special, parse_special, &ids);
  return ids;
}

size_t BpeTokenizer::count_tokens(std::string_view text, bool add_special) const {
  std::vector<int32_t> ids;  // scratch: cached pieces are copied out anyway
  ids.reserve(text.size() / 3 + 4);
  impl_->encode_into(text, add_special, /*parse_special=*/true, &ids);
  return ids.size();
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) continue;
    if (skip_special && impl_->id_kind[static_cast<size_t>(id)] == Impl::kSpecial) continue;
    out += impl_->id_to_bytes[static_cast<size_t>(id)];
  }
  return out;
}

std::string_view BpeTokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return impl_->id_to_bytes[static_cast<size_t>(id)];
}

std::optional<int32_t> BpeTokenizer::token_to_id(std::string_view token) const {
  const auto it = impl_->token_to_id.find(token);
  if (it == impl_->token_to_id.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> BpeTokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= vocab_size() || impl_->id_kind[static_cast<size_t>(id)] == Impl::kNone) {
    return std::nullopt;
  }
  return impl_->id_to_token[static_cast<size_t>(id)];
}

bool BpeTokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && impl_->id_kind[static_cast<size_t>(id)] == Impl::kSpecial;
}

int32_t BpeTokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_kind.size()); }
const BpeOptions& BpeTokenizer::options() const { return impl_->options; }
const std::vector<AddedToken>& BpeTokenizer::added_tokens() const { return impl_->added; }
uint64_t BpeTokenizer::fingerprint() const { return impl_->fingerprint; }

size_t utf8_complete_prefix(std::string_view bytes) {
  // Look at most 3 bytes back for the lead byte of a sequence that the text cuts short.
  const size_t n = bytes.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto lead = static_cast<uint8_t>(bytes[n - back]);
    if ((lead & 0xC0) == 0x80) continue;  // a continuation byte: keep looking
    if (lead < 0xC2 || lead > 0xF4) return n;
    const size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
    if (need <= back) return n;
    if (back == 1) return n - 1;  // a valid lead byte alone: some continuation completes it
    // Pad the present bytes with continuation bytes: valid means the cut-off start is good.
    std::string padded(bytes.substr(n - back));
    padded.resize(need, static_cast<char>(0x80));
    uint32_t cp;
    return decode_utf8(padded, 0, &cp) == static_cast<int>(need) ? n - back : n;
  }
  return n;
}

}  // namespace keep::tok
