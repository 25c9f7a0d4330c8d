#include "services/worker/kernels/attention_schedule.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace keep::kernels {
namespace {

// A boundary of a run of key tiles for one row tile: at key tile `pos`, `touch` rows start (+) or
// stop (-) touching the tiles, and `full` rows start or stop covering them whole.
struct Event {
  int32_t pos;
  int32_t touch;
  int32_t full;
};

}  // namespace

PrefillKernel resolve_prefill_kernel(PrefillKernel asked, int32_t rows, int32_t num_keys, int heads,
                                     int head_dim, int sms, bool wgmma) {
  if (asked != PrefillKernel::kAuto) return asked;
  if (!wgmma) return PrefillKernel::kMma;
  if (head_dim == 128 && num_keys >= kPrefillWideMinKeys) return PrefillKernel::kWgmmaWide;
  const int64_t row_tiles = (int64_t{std::max(rows, 0)} + kPrefillRowTile - 1) / kPrefillRowTile;
  const int64_t blocks = row_tiles * std::max(heads, 0);
  return head_dim == 128 && blocks >= int64_t{kPrefillOneKMinBlocksPerSm} * sms
             ? PrefillKernel::kWgmmaOneK
             : PrefillKernel::kWgmma;
}

int prefill_key_splits(int32_t rows, int32_t num_keys, int heads, int sms) {
  if (rows <= 0 || num_keys <= 0 || heads <= 0 || sms <= 0) return 1;
  const int64_t blocks = (int64_t{rows} + kPrefillRowTile - 1) / kPrefillRowTile * heads;
  const int64_t key_tiles = (int64_t{num_keys} + kPrefillKeyTile - 1) / kPrefillKeyTile;
  const int64_t by_blocks = int64_t{kPrefillSplitBlocksPerSm} * sms / blocks;
  const int64_t by_keys = key_tiles / kPrefillSplitMinTiles;
  const int64_t splits = std::min({by_blocks, by_keys, int64_t{kPrefillSplitMax}});
  return splits >= 2 ? static_cast<int>(splits) : 1;
}

namespace {
size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// Whether a key below num_keys is seen by no row: a slot the call may never have written (the
// slots between a blocks layout's blocks), whose V the kernel then cleans (PrefillSchedule).
// O(spans + num_keys).
bool has_unseen_key(const AttentionRows& rows) {
  if (rows.num_keys <= 0) return false;
  std::vector<int32_t> delta(static_cast<size_t>(rows.num_keys) + 1, 0);
  for (int32_t s = 0; s < rows.row_offsets[rows.rows]; ++s) {
    const KeyRange span = rows.spans[s];
    if (span.end <= span.begin) continue;
    ++delta[static_cast<size_t>(std::max(span.begin, 0))];
    --delta[static_cast<size_t>(std::min(span.end, rows.num_keys))];
  }
  int32_t seen = 0;
  for (int32_t t = 0; t < rows.num_keys; ++t) {
    seen += delta[static_cast<size_t>(t)];
    if (seen <= 0) return true;
  }
  return false;
}
}  // namespace

size_t prefill_split_bytes(int32_t rows, int heads, int head_dim, int splits) {
  if (rows <= 0 || heads <= 0 || head_dim <= 0 || splits <= 1) return 0;
  const size_t items =
      static_cast<size_t>(splits) * static_cast<size_t>(rows) * static_cast<size_t>(heads);
  return align256(items * static_cast<size_t>(head_dim) * 2) + items * sizeof(float);
}

size_t prefill_split_max_bytes(int head_dim, int sms) {
  if (head_dim <= 0 || sms <= 0) return 0;
  // splits x row tiles x heads <= kPrefillSplitBlocksPerSm x sms, each row tile <= 64 rows.
  const size_t items =
      static_cast<size_t>(kPrefillSplitBlocksPerSm) * static_cast<size_t>(sms) * kPrefillRowTile;
  return align256(items * static_cast<size_t>(head_dim) * 2) + items * sizeof(float);
}

// For each row tile, every span of its rows adds two events (the key tiles it touches) and every
// maximal run of contiguous keys of a row (adjacent spans merged) two more (the key tiles it
// covers whole). Sorting the tile's events and sweeping them gives, per run of key tiles, how many
// rows touch them and how many cover them: touched iff > 0, full iff every row of the tile covers
// them. Cost O(S log S + output) for S spans, with no term in num_keys or the number of key tiles;
// a row tile whose events lie within a few times their count of key tiles is swept densely
// instead, O(S + output).
PrefillScheduleHost build_prefill_schedule(const AttentionRows& rows, int32_t row_tile,
                                           int32_t key_tile) {
  if (row_tile <= 0 || key_tile <= 0 || rows.rows < 0) {
    std::fprintf(stderr, "%s:%d: build_prefill_schedule: bad tile sizes (%d, %d) or rows %d\n",
                 __FILE__, __LINE__, row_tile, key_tile, rows.rows);
    std::abort();
  }
  PrefillScheduleHost out;
  out.sanitize_v = rows.rows > 0 && has_unseen_key(rows);
  const int32_t row_tiles = (rows.rows + row_tile - 1) / row_tile;
  out.tile_offsets.reserve(static_cast<size_t>(row_tiles) + 1);
  out.tile_offsets.push_back(0);
  std::vector<Event> events;
  std::vector<int32_t> delta_touch, delta_full;  // per key tile of the dense sweep
  // Key index -> key tile (indices are >= 0): a shift for the usual power-of-two tile, since an
  // integer division per event was most of the cost.
  const bool pow2 = (key_tile & (key_tile - 1)) == 0;
  const int shift = pow2 ? __builtin_ctz(static_cast<unsigned>(key_tile)) : 0;
  const auto tile_of = [pow2, shift, key_tile](int32_t key) {
    return pow2 ? key >> shift : key / key_tile;
  };
  for (int32_t rt = 0; rt < row_tiles; ++rt) {
    const int32_t r_begin = rt * row_tile;
    const int32_t r_end = std::min(rows.rows, r_begin + row_tile);
    const int32_t tile_rows = r_end - r_begin;
    // The key tiles the events fall in: [lo, hi] (every run's whole tiles lie inside).
    int32_t lo = INT32_MAX, hi = INT32_MIN;
    int64_t spans = 0;
    for (int32_t s = rows.row_offsets[r_begin]; s < rows.row_offsets[r_end]; ++s) {
      const KeyRange span = rows.spans[s];
      if (span.end <= span.begin) continue;  // empty spans are invalid; ignore them
      lo = std::min(lo, tile_of(span.begin));
      hi = std::max(hi, tile_of(span.end - 1) + 1);
      ++spans;
    }
    if (spans == 0) {
      out.tile_offsets.push_back(static_cast<int32_t>(out.tiles.size()));
      continue;
    }
    // Few key tiles between the first and the last event (a causal or banded tile): the events
    // are summed per key tile and the range swept, O(S + range); else they are sorted.
    const bool dense = static_cast<int64_t>(hi) - lo < 16 * spans + 64;
    if (dense) {
      delta_touch.assign(static_cast<size_t>(hi - lo) + 1, 0);
      delta_full.assign(static_cast<size_t>(hi - lo) + 1, 0);
    } else {
      events.clear();
    }
    const auto event = [&](int32_t pos, int32_t touch, int32_t full) {
      if (dense) {
        delta_touch[static_cast<size_t>(pos - lo)] += touch;
        delta_full[static_cast<size_t>(pos - lo)] += full;
      } else {
        events.push_back({pos, touch, full});
      }
    };
    // The key tiles wholly inside the run of keys [begin, end) (none when end < 0): a tile ending
    // past the run, in particular a partial last tile (the run ends by num_keys), is not covered.
    const auto add_run = [&](int32_t begin, int32_t end) {
      if (end < 0) return;
      const int32_t fb = tile_of(begin + key_tile - 1);
      const int32_t fe = tile_of(end);
      if (fb < fe) {
        event(fb, 0, 1);
        event(fe, 0, -1);
      }
    };
    for (int32_t r = r_begin; r < r_end; ++r) {
      const int32_t s_begin = rows.row_offsets[r];
      const int32_t s_end = rows.row_offsets[r + 1];
      int32_t run_begin = 0;
      int32_t run_end = -1;  // no open run
      for (int32_t s = s_begin; s < s_end; ++s) {
        const KeyRange span = rows.spans[s];
        if (span.end <= span.begin) continue;
        event(tile_of(span.begin), 1, 0);
        event(tile_of(span.end - 1) + 1, -1, 0);
        if (span.begin == run_end) {
          run_end = span.end;  // adjacent: extend the run
          continue;
        }
        add_run(run_begin, run_end);
        run_begin = span.begin;
        run_end = span.end;
      }
      add_run(run_begin, run_end);
    }
    int32_t touch = 0;
    int32_t full = 0;
    if (dense) {
      for (int32_t kt = lo; kt < hi; ++kt) {  // the last event closes every run
        touch += delta_touch[static_cast<size_t>(kt - lo)];
        full += delta_full[static_cast<size_t>(kt - lo)];
        if (touch > 0) out.tiles.push_back(kt * 2 + (full == tile_rows ? 1 : 0));
      }
    } else {
      std::sort(events.begin(), events.end(),
                [](const Event& a, const Event& b) { return a.pos < b.pos; });
      for (size_t i = 0; i < events.size();) {
        const int32_t pos = events[i].pos;
        for (; i < events.size() && events[i].pos == pos; ++i) {
          touch += events[i].touch;
          full += events[i].full;
        }
        if (touch > 0 && i < events.size()) {  // tiles [pos, next event) are touched
          const int32_t flag = full == tile_rows ? 1 : 0;
          for (int32_t kt = pos; kt < events[i].pos; ++kt) out.tiles.push_back(kt * 2 + flag);
        }
      }
    }
    out.tile_offsets.push_back(static_cast<int32_t>(out.tiles.size()));
  }
  out.visited_pairs = static_cast<int64_t>(out.tiles.size());
  return out;
}

}  // namespace keep::kernels
