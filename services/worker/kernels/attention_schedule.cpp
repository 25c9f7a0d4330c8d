#include "services/worker/kernels/attention_schedule.h"

#include <algorithm>
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

// For each row tile, every span of its rows adds two events (the key tiles it touches) and every
// maximal run of contiguous keys of a row (adjacent spans merged) two more (the key tiles it
// covers whole). Sorting the tile's events and sweeping them gives, per run of key tiles, how many
// rows touch them and how many cover them: touched iff > 0, full iff every row of the tile covers
// them. Cost O(S log S + output) for S spans, with no term in num_keys or the number of key tiles.
PrefillScheduleHost build_prefill_schedule(const AttentionRows& rows, int32_t row_tile,
                                           int32_t key_tile) {
  if (row_tile <= 0 || key_tile <= 0 || rows.rows < 0) {
    std::fprintf(stderr, "%s:%d: build_prefill_schedule: bad tile sizes (%d, %d) or rows %d\n",
                 __FILE__, __LINE__, row_tile, key_tile, rows.rows);
    std::abort();
  }
  PrefillScheduleHost out;
  const int32_t row_tiles = (rows.rows + row_tile - 1) / row_tile;
  out.tile_offsets.reserve(static_cast<size_t>(row_tiles) + 1);
  out.tile_offsets.push_back(0);
  std::vector<Event> events;
  // The key tiles wholly inside the run of keys [begin, end) (none when end < 0): a tile ending
  // past the run, in particular a partial last tile (the run ends by num_keys), is not covered.
  const auto add_run = [&events, key_tile](int32_t begin, int32_t end) {
    if (end < 0) return;
    const int32_t fb = (begin + key_tile - 1) / key_tile;
    const int32_t fe = end / key_tile;
    if (fb < fe) {
      events.push_back({fb, 0, 1});
      events.push_back({fe, 0, -1});
    }
  };
  for (int32_t rt = 0; rt < row_tiles; ++rt) {
    const int32_t r_begin = rt * row_tile;
    const int32_t r_end = std::min(rows.rows, r_begin + row_tile);
    const int32_t tile_rows = r_end - r_begin;
    events.clear();
    for (int32_t r = r_begin; r < r_end; ++r) {
      const int32_t s_begin = rows.row_offsets[r];
      const int32_t s_end = rows.row_offsets[r + 1];
      int32_t run_begin = 0;
      int32_t run_end = -1;  // no open run
      for (int32_t s = s_begin; s < s_end; ++s) {
        const KeyRange span = rows.spans[s];
        if (span.end <= span.begin) continue;  // empty spans are invalid; ignore them
        events.push_back({span.begin / key_tile, 1, 0});
        events.push_back({(span.end - 1) / key_tile + 1, -1, 0});
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
    std::sort(events.begin(), events.end(),
              [](const Event& a, const Event& b) { return a.pos < b.pos; });
    int32_t touch = 0;
    int32_t full = 0;
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
    out.tile_offsets.push_back(static_cast<int32_t>(out.tiles.size()));
  }
  out.visited_pairs = static_cast<int64_t>(out.tiles.size());
  return out;
}

}  // namespace keep::kernels
