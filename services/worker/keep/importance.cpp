#include "services/worker/keep/importance.h"

#include <algorithm>
#include <numeric>
#include <string>

namespace keep::worker {
namespace {

Status invalid(const std::string& msg) {
  return Status(Code::kInvalidArgument, "importance: " + msg);
}

bool ascending_unique(std::span<const int32_t> v) {
  for (size_t i = 1; i < v.size(); ++i) {
    if (v[i] <= v[i - 1]) return false;
  }
  return true;
}

Status validate(const ImportanceInput& in, std::span<const int32_t> candidates,
                std::span<const int32_t> pinned, int32_t keep) {
  if (in.num_segments < 0 || in.num_heads < 1) return invalid("bad segment or head count");
  const size_t rows = in.row_segment.size();
  const size_t columns =
      in.column_segment.empty() ? static_cast<size_t>(in.num_segments) : in.column_segment.size();
  if (in.pooled.size() != rows * columns) {
    return invalid("pooled has " + std::to_string(in.pooled.size()) + " values, expected rows (" +
                   std::to_string(rows) + ") x columns (" + std::to_string(columns) + ")");
  }
  if (!ascending_unique(in.column_segment)) {
    return invalid("column segments must be ascending and unique");
  }
  for (int32_t s : in.column_segment) {
    if (s < 0 || s >= in.num_segments) return invalid("column segment " + std::to_string(s));
  }
  for (int32_t s : in.row_segment) {
    if (s < -1 || s >= in.num_segments) return invalid("row segment " + std::to_string(s));
  }
  for (int32_t r : in.query_rows) {
    if (r < 0 || static_cast<size_t>(r) >= rows) return invalid("query row " + std::to_string(r));
  }
  if (!ascending_unique(candidates) || !ascending_unique(pinned)) {
    return invalid("candidates and pinned must be ascending and unique");
  }
  for (int32_t c : candidates) {
    if (c < 0 || c >= in.num_segments) return invalid("candidate " + std::to_string(c));
    if (!in.column_segment.empty() &&
        !std::binary_search(in.column_segment.begin(), in.column_segment.end(), c)) {
      return invalid("candidate segment " + std::to_string(c) + " has no pooled column");
    }
  }
  for (int32_t p : pinned) {
    if (!std::binary_search(candidates.begin(), candidates.end(), p)) {
      return invalid("pinned segment " + std::to_string(p) + " is not a candidate");
    }
  }
  if (keep < 0) return invalid("keep must be >= 0");
  return Status::ok();
}

}  // namespace

Result<Selection> select_segments(const ImportanceInput& in, std::span<const int32_t> candidates,
                                  std::span<const int32_t> pinned, int32_t keep,
                                  const ImportanceOptions& options) {
  KEEP_RETURN_IF_ERROR(validate(in, candidates, pinned, keep));
  const int32_t G = in.num_segments;
  const size_t C = candidates.size();
  const double H = in.num_heads;
  // Candidate index of each segment (-1: not a candidate).
  std::vector<int32_t> index(static_cast<size_t>(G), -1);
  for (size_t c = 0; c < C; ++c) index[candidates[c]] = static_cast<int32_t>(c);
  // pooled's row stride and the column of each candidate (read in place: no (rows, G) copy).
  const size_t stride =
      in.column_segment.empty() ? static_cast<size_t>(G) : in.column_segment.size();
  std::vector<size_t> column(C);
  for (size_t c = 0; c < C; ++c) {
    column[c] = in.column_segment.empty()
                    ? static_cast<size_t>(candidates[c])
                    : static_cast<size_t>(std::lower_bound(in.column_segment.begin(),
                                                           in.column_segment.end(), candidates[c]) -
                                          in.column_segment.begin());
  }

  // a[i][j] over candidates: the mean attention of i's rows on j (per head). A segment's rows
  // are adjacent: each run of them is summed in double over contiguous floats -- the pooled row
  // itself when the candidates' columns are adjacent (a check layer's always are), else the
  // row's candidate columns gathered first -- so that the sums vectorise (the host's decision is
  // on the GPU's path at a check layer); then the run's sums go into a[i] (once a run, not once
  // a row: ~10 % less time at 40-80 segments in bench_decision).
  std::vector<double> a(C * C, 0.0);
  std::vector<int32_t> row_count(C, 0);
  std::vector<double> run_sum(C);
  std::vector<float> row(C);
  const bool contiguous = C > 0 && column[C - 1] - column[0] == C - 1;  // ascending, distinct
  const size_t R = in.row_segment.size();
  for (size_t r = 0; r < R;) {
    const int32_t seg = in.row_segment[r];
    size_t end = r + 1;
    while (end < R && in.row_segment[end] == seg) ++end;
    if (seg < 0 || index[seg] < 0) {
      r = end;
      continue;
    }
    const size_t i = static_cast<size_t>(index[seg]);
    row_count[i] += static_cast<int32_t>(end - r);
    std::fill(run_sum.begin(), run_sum.end(), 0.0);
    double* const sum = run_sum.data();
    for (; r < end; ++r) {
      const float* p = in.pooled.data() + r * stride;
      if (contiguous) {
        p += column[0];
      } else {
        for (size_t j = 0; j < C; ++j) row[j] = p[column[j]];
        p = row.data();
      }
      for (size_t j = 0; j < C; ++j) sum[j] += p[j];
    }
    for (size_t j = 0; j < C; ++j) a[i * C + j] += sum[j];
  }
  for (size_t i = 0; i < C; ++i) {
    if (row_count[i] == 0) {
      return invalid("candidate segment " + std::to_string(candidates[i]) +
                     " has no rows at this layer");
    }
    for (size_t j = 0; j < C; ++j) a[i * C + j] /= H * row_count[i];
  }

  // Hop 0: what the last q query rows read.
  std::vector<double> s(C, 0.0);
  const size_t q = std::min<size_t>(in.query_rows.size(),
                                    static_cast<size_t>(std::max(options.query_rows_used, 0)));
  for (size_t k = in.query_rows.size() - q; k < in.query_rows.size(); ++k) {
    const size_t r = static_cast<size_t>(in.query_rows[k]);
    const float* p = in.pooled.data() + r * stride;
    for (size_t j = 0; j < C; ++j) s[j] += p[column[j]];
  }
  if (q > 0) {
    for (double& v : s) v /= H * static_cast<double>(q);
  }

  std::vector<uint8_t> is_pinned(C, 0);
  for (int32_t p : pinned) is_pinned[index[p]] = 1;
  const size_t want = std::max(pinned.size(), std::min(C, static_cast<size_t>(keep)));
  // Pinned first, then by score, ties to the earlier segment; returns candidate indices, sorted.
  auto select = [&] {
    std::vector<size_t> order(C);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
      if (is_pinned[x] != is_pinned[y]) return is_pinned[x] > is_pinned[y];
      return s[x] > s[y];
    });
    order.resize(want);
    std::sort(order.begin(), order.end());
    return order;
  };

  Selection out;
  std::vector<size_t> sel = select();
  if (want < C) {
    out.converged = false;
    while (out.hops < options.max_hops) {
      double total = 0;
      for (size_t j : sel) total += s[j];
      if (total <= 0) {  // nothing to spread: further hops change nothing
        out.converged = true;
        break;
      }
      std::vector<double> add(C, 0.0);
      for (size_t j : sel) {
        const double w = s[j] / total;
        for (size_t i = 0; i < C; ++i) {
          if (i != j) add[i] += w * (a[j * C + i] + a[i * C + j]);
        }
      }
      for (size_t i = 0; i < C; ++i) s[i] += add[i];
      ++out.hops;
      std::vector<size_t> next = select();
      if (next == sel) {
        out.converged = true;
        break;
      }
      sel = std::move(next);
    }
  }
  out.selected.reserve(sel.size());
  for (size_t c : sel) out.selected.push_back(candidates[c]);
  out.score.assign(static_cast<size_t>(G), 0.0);
  for (size_t c = 0; c < C; ++c) out.score[candidates[c]] = s[c];
  return out;
}

}  // namespace keep::worker
