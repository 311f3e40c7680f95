// DynaPipe micro-batching DP in C++: the twin of dyn_plugin/plan/steps/microbatch.py (same loops,
// same order, same tie-breaking, same arithmetic, so both give the same plan). Costs come from
// CostTable (cost_table.hpp) directly: no Python call per query.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cost_table.hpp"

namespace dyn {

struct StageShape {
  int64_t num_layers;
  bool first, last;
};

struct StageMemory {
  double budget;
  int64_t in_flight;
};

// What sequence parallelism adds to one transformer layer (cost/sequence_parallel.py LayerComm):
// collectives, ms = a + b * token slots per rank, {forward a, forward b, backward a, backward b},
// then the executor's buffers, bytes = per slot * slots + per pair * attention pairs per rank,
// {stored per slot, stored per pair, transient fixed, transient per slot, transient per pair}.
using LayerComm = std::array<double, 9>;

struct RunCosts {
  // times[i][w], modes[i][w]: run [i, i + w + 1) of the longest-first order
  std::vector<std::vector<double>> times;
  std::vector<std::vector<int>> modes;
};

// Runs are priced per rank of a sequence-parallel group of sp; comm (empty, or one per table,
// i.e. per recompute mode) adds every layer's collectives to each stage's forward and backward.
inline RunCosts run_costs(const std::vector<int64_t>& lens, const std::vector<const CostTable*>& tables,
                          const std::vector<StageShape>& stages, const std::vector<StageMemory>& memory,
                          int64_t sp = 1, const std::vector<LayerComm>& comm = {}) {
  const int64_t n = static_cast<int64_t>(lens.size());
  RunCosts rc;
  rc.times.resize(n);
  rc.modes.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    int64_t total = 0, square = 0, longest = 0;
    for (int64_t j = i + 1; j <= n; ++j) {
      const int64_t l = lens[j - 1];
      total += l;
      square += l * l;
      if (l > longest) longest = l;
      double best = std::numeric_limits<double>::infinity();
      int best_mode = -1;
      for (size_t mi = 0; mi < tables.size(); ++mi) {
        const CostTable& t = *tables[mi];
        const Features f = t.from_sums(j - i, total, square, longest, sp);
        if (!t.in_range(f)) continue;
        double time = 0;
        bool fits = true;
        for (size_t s = 0; s < stages.size(); ++s) {
          const StageCost c = t.stage_cost(f, stages[s].num_layers, stages[s].first, stages[s].last);
          const double layers = double(stages[s].num_layers);
          double stored = c.stored_bytes, peak = c.peak_bytes;
          if (!comm.empty()) {
            const LayerComm& k = comm[mi];
            const double kept = layers * (k[4] * f.slots + k[5] * f.attn);
            stored += kept;
            peak += kept + (k[6] + k[7] * f.slots + k[8] * f.attn);
          }
          if (double(memory[s].in_flight) * stored + (peak - stored) > memory[s].budget) {
            fits = false;
            break;
          }
          double fwd = c.forward_ms, bwd = c.backward_ms;
          if (!comm.empty()) {
            const LayerComm& k = comm[mi];
            fwd += layers * (k[0] + k[1] * f.slots);
            bwd += layers * (k[2] + k[3] * f.slots);
          }
          time = std::max(time, fwd + bwd);
        }
        if (fits && time < best) {
          best = time;
          best_mode = int(mi);
        }
      }
      if (best_mode < 0) break;  // memory only grows with the run
      rc.times[i].push_back(best);
      rc.modes[i].push_back(best_mode);
    }
  }
  return rc;
}

// Least total time covering all samples with a micro-batch count divisible by dp; false if none.
inline bool partition_dp(const RunCosts& rc, double t_max, int64_t dp, double* total, std::vector<int64_t>* bounds) {
  const int64_t n = static_cast<int64_t>(rc.times.size());
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> f((n + 1) * dp, inf);
  std::vector<int64_t> back((n + 1) * dp, -1);
  f[0] = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const auto& ts = rc.times[i];
    for (int64_t k = 0; k < dp; ++k) {
      const double fi = f[i * dp + k];
      if (fi == inf) continue;
      const int64_t nk = (k + 1) % dp;
      for (size_t w = 0; w < ts.size(); ++w) {
        if (ts[w] > t_max) break;
        const int64_t j = i + int64_t(w) + 1;
        const double v = fi + ts[w];
        if (v < f[j * dp + nk]) {
          f[j * dp + nk] = v;
          back[j * dp + nk] = i;
        }
      }
    }
  }
  if (f[n * dp] == inf) return false;
  *total = f[n * dp];
  if (bounds) {
    bounds->clear();
    bounds->push_back(n);
    int64_t j = n, k = 0;
    while (j > 0) {
      const int64_t i = back[j * dp + k];
      bounds->push_back(i);
      j = i;
      k = ((k - 1) % dp + dp) % dp;
    }
    std::reverse(bounds->begin(), bounds->end());
  }
  return true;
}

struct PartitionResult {
  bool ok = false;
  int64_t infeasible_at = -1;  // position in the order of a sample that fits nowhere
  std::vector<int64_t> bounds;
  std::vector<int> modes;
  double t_max = 0, objective = 0;
};

inline std::vector<double> candidates(const RunCosts& rc, double thin) {
  double lower = 0;
  std::vector<double> all;
  for (const auto& t : rc.times) {
    lower = std::max(lower, t[0]);
    all.insert(all.end(), t.begin(), t.end());
  }
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  std::vector<double> kept;
  for (double v : all) {
    if (v < lower) continue;
    if (kept.empty() || v >= kept.back() * (1 + thin)) kept.push_back(v);
  }
  if (!all.empty() && kept.back() != all.back()) kept.push_back(all.back());
  return kept;
}

inline PartitionResult partition(const std::vector<int64_t>& sorted_lens, const std::vector<const CostTable*>& tables,
                                 const std::vector<StageShape>& stages, const std::vector<StageMemory>& memory,
                                 int64_t dp, double thin, int64_t sp = 1, const std::vector<LayerComm>& comm = {}) {
  PartitionResult r;
  const RunCosts rc = run_costs(sorted_lens, tables, stages, memory, sp, comm);
  for (size_t i = 0; i < rc.times.size(); ++i)
    if (rc.times[i].empty()) {
      r.infeasible_at = int64_t(i);
      return r;
    }
  const int64_t pp = int64_t(stages.size());
  double floor_total = 0;
  const bool has_floor = partition_dp(rc, std::numeric_limits<double>::infinity(), dp, &floor_total, nullptr);
  double best = std::numeric_limits<double>::infinity();
  bool found = false;
  for (double t_max : candidates(rc, thin)) {
    if (found && has_floor && double(pp - 1) * t_max + floor_total / double(dp) >= best) break;
    double total;
    std::vector<int64_t> bounds;
    if (!partition_dp(rc, t_max, dp, &total, &bounds)) continue;
    const double obj = double(pp - 1) * t_max + total / double(dp);
    if (!found || obj < best) {
      found = true;
      best = obj;
      r.t_max = t_max;
      r.bounds = bounds;
    }
  }
  if (!found) return r;
  r.ok = true;
  r.objective = best;
  for (size_t m = 0; m + 1 < r.bounds.size(); ++m) {
    const int64_t a = r.bounds[m], b = r.bounds[m + 1];
    r.modes.push_back(rc.modes[a][b - a - 1]);
  }
  return r;
}

}  // namespace dyn
