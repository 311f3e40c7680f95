// Multiple-choice knapsack with a shared reserve: the twin of dyn_plugin/plan/sharding/knapsack.py (same
// candidates in the same order, one addition each, the first least one kept), so both return the
// same choices and bit-identical frontiers.
//
// Item i takes exactly one choice c: weight w[i][c] units, time t[i][c] (infinite: not allowed).
// Choices that "open" (gather parameters on use) also need the reserve of the largest opened
// item once: items come in descending reserve order, so the first opened item fixes it. Two
// tables per memory level m: N (nothing opened yet, m excludes any reserve) and G (the reserve
// is fixed and counted in m).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace dyn {

struct KnapsackResult {
  bool ok = false;
  std::vector<int64_t> choice;  // per item, in the order given
  int64_t weight = 0;           // units used, the reserve included
  std::vector<double> frontier;  // [capacity + 1]: best time within m units
};

struct KnapsackRow {
  int64_t choice, shift;
  bool from_n;  // fed by N (every N row; a G row: this choice opens, and pays the reserve here)
};

// The candidates of item i, in the order they are compared: N rows (choices that do not open),
// and G rows (every choice from G; an opening choice also from N, paying the reserve).
inline void item_rows(const std::vector<int64_t>& w, const std::vector<double>& t, const std::vector<uint8_t>& opens,
                      int64_t reserve, int64_t i, int64_t choices, int64_t capacity, std::vector<KnapsackRow>* rn,
                      std::vector<KnapsackRow>* rg) {
  rn->clear();
  rg->clear();
  for (int64_t c = 0; c < choices; ++c) {
    const int64_t k = i * choices + c;
    if (!(t[k] < std::numeric_limits<double>::infinity()) || w[k] > capacity) continue;
    if (!opens[k]) rn->push_back({c, w[k], true});
    rg->push_back({c, w[k], false});
    if (opens[k] && w[k] + reserve <= capacity) rg->push_back({c, w[k] + reserve, true});
  }
}

// out[m] = least n-or-g[m - shift] + t[choice] over the rows: row by row over every level (the
// same comparisons per level as a level-by-level loop, in a loop the compiler vectorises).
inline void least(const std::vector<KnapsackRow>& rows, const double* n, const double* g, const double* t,
                  double* out, int64_t U) {
  std::fill(out, out + U, std::numeric_limits<double>::infinity());
  for (const KnapsackRow& r : rows) {
    const double* src = (r.from_n ? n : g) - r.shift;
    const double tc = t[r.choice];
    for (int64_t m = r.shift; m < U; ++m) {
      const double v = src[m] + tc;
      out[m] = v < out[m] ? v : out[m];
    }
  }
}

// w, t, opens: row-major [items][choices]; reserve: [items], descending.
inline KnapsackResult knapsack(const std::vector<int64_t>& w, const std::vector<double>& t,
                               const std::vector<uint8_t>& opens, const std::vector<int64_t>& reserve,
                               int64_t items, int64_t choices, int64_t capacity) {
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t U = capacity + 1;
  // tables before each item and after the last: n[i * U + m], g[i * U + m]
  std::vector<double> n((items + 1) * U, inf), g((items + 1) * U, inf);
  n[0] = 0.0;
  std::vector<KnapsackRow> rn, rg;
  for (int64_t i = 0; i < items; ++i) {
    item_rows(w, t, opens, reserve[i], i, choices, capacity, &rn, &rg);
    least(rn, &n[i * U], &g[i * U], &t[i * choices], &n[(i + 1) * U], U);
    least(rg, &n[i * U], &g[i * U], &t[i * choices], &g[(i + 1) * U], U);
  }
  KnapsackResult res;
  res.frontier.resize(U);
  const double* nl = &n[items * U];
  const double* gl = &g[items * U];
  double run = inf, top = inf;
  int64_t at = -1;
  for (int64_t m = 0; m < U; ++m) {
    const double b = nl[m] <= gl[m] ? nl[m] : gl[m];
    if (b < top) {
      top = b;
      at = m;
    }
    run = b < run ? b : run;
    res.frontier[m] = run;
  }
  if (at < 0) return res;
  res.ok = true;
  res.weight = at;
  res.choice.assign(items, -1);
  // back from the last item: the first candidate that gives the table's value is the one kept
  bool in_g = !(nl[at] <= gl[at]);
  int64_t m = at;
  for (int64_t i = items - 1; i >= 0; --i) {
    item_rows(w, t, opens, reserve[i], i, choices, capacity, &rn, &rg);
    const double value = (in_g ? g : n)[(i + 1) * U + m];
    for (const KnapsackRow& r : in_g ? rg : rn) {
      if (m < r.shift) continue;
      const double* src = r.from_n ? &n[i * U] : &g[i * U];
      if (src[m - r.shift] + t[i * choices + r.choice] == value) {
        res.choice[i] = r.choice;
        m -= r.shift;
        in_g = in_g && !r.from_n;
        break;
      }
    }
  }
  return res;
}

}  // namespace dyn
