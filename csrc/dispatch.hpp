// Hydraulis's stage 1, the twin of dyn_plugin/plan/assignment/dispatch.py: the greedy (sequences in the
// given order, each onto the pipeline where it would finish earliest; a heap per kind) and the
// local improvement (moves and swaps off the pipeline with the largest finish). Same candidates,
// same ties, same floating-point operations in the same order as the Python, so both return
// bit-identical results.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <tuple>
#include <vector>

namespace dyn {

struct DispatchResult {
  int64_t bad = -1;  // a sequence that fits no pipeline, or -1
  std::vector<std::vector<int64_t>> members;
  std::vector<double> finish;
};

namespace detail {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The second largest of a pipeline's times on its kind (the largest again if it occurs twice;
// 0 with fewer than two sequences).
inline double second(const double* row, const std::vector<int64_t>& members) {
  if (members.size() < 2) return 0.0;
  double a = -kInf, b = -kInf;
  for (int64_t i : members) {
    const double v = row[i];
    if (v > a) {
      b = a;
      a = v;
    } else if (v > b) {
      b = v;
    }
  }
  return b;
}

inline bool better(double f, int64_t p, double best_f, int64_t best_p) {
  return f < best_f || (f == best_f && p < best_p);
}

}  // namespace detail

// times: row-major [K][n]; kinds: [P]; fill: [K]; order: the sequences in dispatch order.
inline DispatchResult dispatch(const std::vector<double>& times, const std::vector<int64_t>& kinds,
                               const std::vector<double>& fill, const std::vector<int64_t>& order, int64_t n,
                               int64_t rounds) {
  using detail::kInf;
  const int64_t P = static_cast<int64_t>(kinds.size()), K = static_cast<int64_t>(fill.size());
  DispatchResult res;
  std::vector<double> load(P, 0.0), hi(P, 0.0);
  std::vector<std::vector<int64_t>>& members = res.members;
  members.assign(P, {});
  std::vector<std::vector<int64_t>> of_kind(K);
  for (int64_t p = 0; p < P; ++p) of_kind[kinds[p]].push_back(p);
  std::vector<size_t> used(K, 0);
  using Entry = std::tuple<double, int64_t, int64_t>;  // (load + fill * longest, pipeline, version)
  std::vector<std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>>> heaps(K);
  std::vector<int64_t> version(P, 0);
  std::vector<double> floor(K, kInf);

  // the greedy (dispatch.py: _greedy)
  for (int64_t i : order) {
    double best_f = kInf;
    int64_t best_p = -1;
    for (int64_t t = 0; t < K; ++t) {
      const double x = times[t * n + i];
      if (!(x < kInf)) continue;
      const double f = fill[t];
      if (x <= floor[t]) {
        auto& heap = heaps[t];
        while (!heap.empty() && std::get<2>(heap.top()) != version[std::get<1>(heap.top())]) heap.pop();
        if (!heap.empty()) {
          const double finish = std::get<0>(heap.top()) + x;
          const int64_t p = std::get<1>(heap.top());
          if (detail::better(finish, p, best_f, best_p)) best_f = finish, best_p = p;
        }
      } else {
        double a_key = kInf, b_load = kInf, low = kInf;
        int64_t a_p = -1, b_p = -1;
        for (size_t u = 0; u < used[t]; ++u) {
          const int64_t p = of_kind[t][u];
          low = std::min(low, hi[p]);
          if (hi[p] >= x) {
            const double key = load[p] + f * hi[p];
            if (key < a_key) a_key = key, a_p = p;
          } else if (load[p] < b_load) {
            b_load = load[p], b_p = p;
          }
        }
        floor[t] = low;
        const double fa = a_key + x, fb = (b_load + f * x) + x;
        if (a_p >= 0 && detail::better(fa, a_p, best_f, best_p)) best_f = fa, best_p = a_p;
        if (b_p >= 0 && detail::better(fb, b_p, best_f, best_p)) best_f = fb, best_p = b_p;
      }
      if (used[t] < of_kind[t].size()) {
        const double finish = f * x + x;
        const int64_t p = of_kind[t][used[t]];
        if (detail::better(finish, p, best_f, best_p)) best_f = finish, best_p = p;
      }
    }
    if (best_p < 0) {
      res.bad = i;
      res.members.clear();
      return res;
    }
    const int64_t p = best_p, t = kinds[p];
    const double x = times[t * n + i];
    if (members[p].empty()) {
      ++used[t];
      floor[t] = std::min(floor[t], x);
    }
    load[p] += x;
    hi[p] = std::max(hi[p], x);
    members[p].push_back(i);
    ++version[p];
    heaps[t].emplace(load[p] + fill[t] * hi[p], p, version[p]);
  }

  // local improvement (dispatch.py: _improve)
  std::vector<double> lo(P), fill_p(P);
  std::vector<int64_t> owner(n, -1);
  for (int64_t p = 0; p < P; ++p) {
    lo[p] = detail::second(&times[kinds[p] * n], members[p]);
    fill_p[p] = fill[kinds[p]];
    for (int64_t i : members[p]) owner[i] = p;
  }
  std::vector<double> xj, rest_long, rest_load, tk(n), without_k(n);
  for (int64_t round = 0; round < rounds; ++round) {
    int64_t s = 0;
    double M = -kInf;
    for (int64_t p = 0; p < P; ++p) {
      const double fin = load[p] + fill_p[p] * hi[p];
      if (fin > M) M = fin, s = p;
    }
    const std::vector<int64_t> J = members[s];
    const int64_t m = static_cast<int64_t>(J.size()), ts = kinds[s];
    const double fs = fill[ts];
    xj.resize(m), rest_long.resize(m), rest_load.resize(m);
    for (int64_t a = 0; a < m; ++a) {
      xj[a] = times[ts * n + J[a]];
      rest_long[a] = xj[a] == hi[s] ? lo[s] : hi[s];
      rest_load[a] = m > 1 ? load[s] - xj[a] : 0.0;
    }
    double move_v = kInf, move_y = 0.0;
    int64_t move_j = -1, move_d = -1;
    for (int64_t a = 0; a < m; ++a) {
      const double new_s = rest_load[a] + fs * rest_long[a];
      for (int64_t d = 0; d < P; ++d) {
        const double y = times[kinds[d] * n + J[a]];
        if (d == s || !(y < kInf)) continue;
        const double new_d = (load[d] + y) + fill_p[d] * std::max(hi[d], y);
        const double v = std::max(new_s, new_d);
        if (v < move_v) move_v = v, move_j = a, move_d = d, move_y = y;
      }
    }
    for (int64_t k = 0; k < n; ++k) {
      const int64_t o = owner[k];
      tk[k] = times[kinds[o] * n + k];
      without_k[k] = tk[k] == hi[o] ? lo[o] : hi[o];
    }
    double swap_v = kInf;
    int64_t swap_j = -1, swap_k = -1;
    for (int64_t a = 0; a < m; ++a) {
      for (int64_t k = 0; k < n; ++k) {
        const int64_t o = owner[k];
        const double xk = times[ts * n + k], y = times[kinds[o] * n + J[a]];
        if (o == s || !(y < kInf) || !(xk < kInf)) continue;
        const double new_s = (rest_load[a] + xk) + fs * std::max(rest_long[a], xk);
        const double new_k = ((load[o] - tk[k]) + y) + fill_p[o] * std::max(without_k[k], y);
        const double v = std::max(new_s, new_k);
        if (v < swap_v) swap_v = v, swap_j = a, swap_k = k;
      }
    }
    if (!(std::min(move_v, swap_v) < M)) break;
    if (move_v <= swap_v) {
      const int64_t i = J[move_j], d = move_d;
      members[s].erase(std::find(members[s].begin(), members[s].end(), i));
      members[d].push_back(i);
      owner[i] = d;
      load[s] = rest_load[move_j], hi[s] = rest_long[move_j];
      load[d] = load[d] + move_y, hi[d] = std::max(hi[d], move_y);
      lo[s] = detail::second(&times[ts * n], members[s]);
      lo[d] = detail::second(&times[kinds[d] * n], members[d]);
    } else {
      const int64_t i = J[swap_j], k = swap_k, d = owner[k];
      const double xk = times[ts * n + k], y = times[kinds[d] * n + i];
      members[s].erase(std::find(members[s].begin(), members[s].end(), i));
      members[d].push_back(i);
      owner[i] = d;
      members[d].erase(std::find(members[d].begin(), members[d].end(), k));
      members[s].push_back(k);
      owner[k] = s;
      load[s] = rest_load[swap_j] + xk, hi[s] = std::max(rest_long[swap_j], xk);
      load[d] = (load[d] - tk[k]) + y, hi[d] = std::max(without_k[k], y);
      lo[s] = detail::second(&times[ts * n], members[s]);
      lo[d] = detail::second(&times[kinds[d] * n], members[d]);
    }
  }
  res.finish.resize(P);
  for (int64_t p = 0; p < P; ++p) res.finish[p] = load[p] + fill_p[p] * hi[p];
  return res;
}

}  // namespace dyn
