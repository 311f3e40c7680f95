// Native twin of dyn_plugin/cost/table.py: evaluates a cost table without calling Python.
// Planners (csrc/*) include this header and call stage_cost() in their inner loops.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

namespace dyn {

enum Component { kEmbedding = 0, kLayer = 1, kHead = 2, kNumComponents = 3 };
enum Metric { kForward = 0, kBackward = 1, kStored = 2, kPeak = 3, kNumMetrics = 4 };

struct Features {
  double slots;  // token slots: real tokens plus padding
  double attn;
  int64_t max_len;
};

struct StageCost {
  double forward_ms = 0, backward_ms = 0, stored_bytes = 0, peak_bytes = 0;
  bool extrapolated = false;
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct CostTable {
  // coef[component][metric] = {c0, c1, c2, floor}: y = max(floor, c0 + c1 * tokens + c2 * attn)
  std::array<std::array<std::array<double, 4>, kNumMetrics>, kNumComponents> coef{};
  // bands[c][m]: rows of (upper length, c0, c1, c2), piecewise in the length attn / slots (cost/table.py
  // LinearFit.bands): the first row whose upper length is not below it applies, coef beyond the last
  std::array<std::array<std::vector<std::array<double, 4>>, kNumMetrics>, kNumComponents> bands{};
  bool packed = false;
  int64_t pad_multiple = 8;
  double max_tokens = 0, max_len = 0;

  // Per rank of a sequence-parallel group of sp (cost/model.py features): n sequences of `total`
  // tokens, sum of squares `square`. The row is rounded up to a multiple of sp (a packed row by a
  // padding document of `fill` tokens, a causal block of its own); each rank runs 1/sp of the
  // slots and of the attention. sp = 1 is the plain micro-batch.
  Features from_sums(int64_t n, int64_t total, int64_t square, int64_t longest, int64_t sp) const {
    const double k = double(sp);
    if (packed) {
      const int64_t width = round_up(total, sp), fill = width - total;
      return {double(width) / k, double(square + fill * fill) / k, longest};
    }
    const int64_t s = round_up(round_up(longest, pad_multiple), sp);
    return {double(n) * double(s) / k, double(n) * double(s) * double(s) / k, s};
  }

  Features features(const int64_t* lens, int64_t n, int64_t sp = 1) const {
    int64_t longest = 0, total = 0, square = 0;
    for (int64_t i = 0; i < n; ++i) {
      longest = std::max(longest, lens[i]);
      total += lens[i];
      square += lens[i] * lens[i];
    }
    return from_sums(n, total, square, longest, sp);
  }

  double eval(int c, int m, const Features& f) const {
    const auto& k = coef[c][m];
    double c0 = k[0], c1 = k[1], c2 = k[2];
    if (!bands[c][m].empty()) {
      const double length = f.attn / f.slots;
      for (const auto& b : bands[c][m]) {
        if (length <= b[0]) {
          c0 = b[1], c1 = b[2], c2 = b[3];
          break;
        }
      }
    }
    return std::max(k[3], c0 + c1 * f.slots + c2 * f.attn);
  }

  bool in_range(const Features& f) const { return f.slots <= max_tokens && f.max_len <= max_len; }

  // Components summed over the stage; peak = all stored + the worst single transient.
  StageCost stage_cost(const Features& f, int64_t num_layers, bool first, bool last) const {
    const int64_t counts[kNumComponents] = {first ? 1 : 0, num_layers, last ? 1 : 0};
    StageCost r;
    double transient = 0;
    for (int c = 0; c < kNumComponents; ++c) {
      if (counts[c] == 0) continue;
      const double k = double(counts[c]);
      r.forward_ms += k * eval(c, kForward, f);
      r.backward_ms += k * eval(c, kBackward, f);
      const double s = eval(c, kStored, f);
      r.stored_bytes += k * s;
      transient = std::max(transient, eval(c, kPeak, f) - s);
    }
    r.peak_bytes = r.stored_bytes + transient;
    r.extrapolated = !in_range(f);
    return r;
  }
};

}  // namespace dyn
