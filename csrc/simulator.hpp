// The twin of dyn_plugin/plan/steps/simulator.py: one pipeline replica's schedule checked
// (_check_complete's op checks), run (simulate's worklist over stages) and its activation peak per
// stage taken (memory_steps). Same worklist order, same floating-point operations in the same
// order and the same error messages as the Python, so both return bit-identical results; the
// planner runs it thousands of times a step (every schedule, recompute and split-backward trial).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace dyn {

// One micro-batch as the simulator needs it: per stage its times and bytes (weight and deferred
// empty where its backward is not split), and what it sends between stages.
struct SimMicroBatch {
  std::vector<double> fwd, bwd, weight, stored, peak, deferred;
  double activation_bytes = 0.0;
  std::vector<double> link_bytes;  // per link s -> s+1, or empty: activation_bytes on every link
};

// LinkSpec.transfer_ms, the same operations in the same order.
struct Link {
  double gb_per_s, latency_us;
  double transfer_ms(double nbytes) const { return latency_us / 1e3 + nbytes / (gb_per_s * 1e9) * 1e3; }
};

// One stage's ops in order: kinds[k] is 'F', 'B', 'I' or 'W', on micro-batch mbs[k].
struct StageOps {
  std::string kinds;
  std::vector<int64_t> mbs;
};

struct SimEvent {
  int64_t stage;
  int stream;  // 0 compute, 1 the send of an activation downstream, 2 of a gradient upstream
  char kind;
  int64_t mb;
  double start, end;
};

using Matrix = std::vector<std::vector<double>>;  // [stage or link][micro-batch]

struct SimOutput {
  double makespan = 0.0;
  std::vector<double> busy;  // per stage, ms computing
  std::vector<double> peak;  // per stage, activation bytes
  std::vector<SimEvent> events;
};

namespace detail {

inline std::string op_name(char kind, int64_t mb) { return std::string(1, kind) + std::to_string(mb); }

inline std::invalid_argument stage_error(size_t s, const std::string& what) {
  return std::invalid_argument("stage " + std::to_string(s) + ": " + what);
}

// _check_complete's checks of the ops (the micro-batches' own sizes are checked in Python).
inline void check_ops(const std::vector<StageOps>& stages, const std::vector<SimMicroBatch>& micro_batches) {
  const int64_t m = static_cast<int64_t>(micro_batches.size());
  if (stages.empty()) throw std::invalid_argument("schedule has no stages");
  for (size_t s = 0; s < stages.size(); ++s) {
    std::vector<std::string> seen(static_cast<size_t>(m));  // per micro-batch, its kinds so far in order
    const auto& ops = stages[s];
    for (size_t k = 0; k < ops.kinds.size(); ++k) {
      const char kind = ops.kinds[k];
      const int64_t mb = ops.mbs[k];
      if ((kind != 'F' && kind != 'B' && kind != 'I' && kind != 'W') || mb < 0 || mb >= m)
        throw stage_error(s, "unknown op " + op_name(kind, mb));
      std::string& had = seen[static_cast<size_t>(mb)];
      const auto has = [&had](char c) { return had.find(c) != std::string::npos; };
      if (has(kind)) throw stage_error(s, "op " + op_name(kind, mb) + " appears twice");
      if (kind == 'W' && !has('I')) throw stage_error(s, "op W" + std::to_string(mb) + " comes before I" + std::to_string(mb));
      if ((kind == 'B' || kind == 'I') && (has('B') || has('I')))
        throw stage_error(s, "micro-batch " + std::to_string(mb) + " runs both B and I (a backward is whole or split)");
      if (kind == 'I' && micro_batches[static_cast<size_t>(mb)].weight.empty())
        throw stage_error(s, "micro-batch " + std::to_string(mb) + "'s split backward is not priced (no weight_ms)");
      had.push_back(kind);
    }
    for (int64_t i = 0; i < m; ++i) {
      const std::string& had = seen[static_cast<size_t>(i)];
      const auto has = [&had](char c) { return had.find(c) != std::string::npos; };
      char missing = 0;
      if (!has('F'))
        missing = 'F';
      else if (!has('B') && !has('I'))
        missing = 'B';
      else if (has('I') && !has('W'))
        missing = 'W';
      if (missing) throw stage_error(s, "op " + op_name(missing, i) + " is missing");
    }
  }
}

// memory_steps' largest "during" of one stage (stage_peak_bytes; 0 without ops).
inline double stage_peak(const StageOps& ops, const std::vector<SimMicroBatch>& micro_batches, size_t stage) {
  double alive = 0.0, most = -std::numeric_limits<double>::infinity();
  for (size_t k = 0; k < ops.kinds.size(); ++k) {
    const char kind = ops.kinds[k];
    const SimMicroBatch& mb = micro_batches[static_cast<size_t>(ops.mbs[k])];
    const double stored = mb.stored[stage];
    double during;
    if (kind == 'W') {
      during = alive;
      alive -= mb.deferred[stage];
    } else {
      if (kind == 'F') alive += stored;
      during = (alive - stored) + mb.peak[stage];
      if (kind == 'B')
        alive -= stored;
      else if (kind == 'I')
        alive += mb.deferred[stage] - stored;
    }
    most = std::max(most, during);
  }
  return ops.kinds.empty() ? 0.0 : most;
}

}  // namespace detail

inline SimOutput simulate(const std::vector<StageOps>& stages, const std::vector<SimMicroBatch>& micro_batches,
                          const Link& link, bool record) {
  const size_t n = stages.size();
  const size_t m = micro_batches.size();
  detail::check_ops(stages, micro_batches);
  const size_t last = n - 1;
  // when a micro-batch's activation (gradient) is available on a stage, where has_* says it is (Python's None)
  Matrix act_ready(n, std::vector<double>(m, 0.0)), grad_ready(n, std::vector<double>(m, 0.0));
  std::vector<std::vector<char>> has_act(n, std::vector<char>(m, 0)), has_grad(n, std::vector<char>(m, 0));
  std::fill(has_act[0].begin(), has_act[0].end(), 1);
  std::vector<std::vector<char>> fwd_done(n, std::vector<char>(m, 0));
  std::vector<double> fwd_link_free(n, 0.0), bwd_link_free(n, 0.0), clock(n, 0.0);
  std::vector<size_t> pos(n, 0);
  SimOutput out;
  out.busy.assign(n, 0.0);

  // per stage (link) and micro-batch, so the loop below reads flat rows; a split backward's I is
  // the backward less its W
  Matrix fwd(n, std::vector<double>(m)), bwd(n, std::vector<double>(m)), weight(n, std::vector<double>(m, 0.0));
  Matrix transfer(n ? n - 1 : 0, std::vector<double>(m));
  for (size_t i = 0; i < m; ++i) {
    const SimMicroBatch& mb = micro_batches[i];
    for (size_t s = 0; s < n; ++s) {
      fwd[s][i] = mb.fwd[s];
      bwd[s][i] = mb.bwd[s];
      if (!mb.weight.empty()) weight[s][i] = mb.weight[s];
    }
    for (size_t s = 0; s + 1 < n; ++s)
      transfer[s][i] = link.transfer_ms(mb.link_bytes.empty() ? mb.activation_bytes : mb.link_bytes[s]);
  }

  std::vector<size_t> pending;
  for (size_t s = n; s-- > 0;) pending.push_back(s);
  std::vector<char> queued(n, 1);
  while (!pending.empty()) {
    const size_t s = pending.back();
    pending.pop_back();
    queued[s] = 0;
    const auto& ops = stages[s];
    bool sent_fwd = false, sent_bwd = false;
    while (pos[s] < ops.kinds.size()) {
      const char kind = ops.kinds[pos[s]];
      const size_t i = static_cast<size_t>(ops.mbs[pos[s]]);
      double start, end;
      if (kind == 'F') {
        if (!has_act[s][i]) break;
        const double ready = act_ready[s][i];
        start = std::max(clock[s], ready);
        end = start + fwd[s][i];
        fwd_done[s][i] = 1;
      } else if (kind == 'W') {
        start = clock[s];
        end = start + weight[s][i];
      } else {
        if (!fwd_done[s][i])
          throw detail::stage_error(s, "op " + detail::op_name(kind, static_cast<int64_t>(i)) + " comes before F" +
                                           std::to_string(i));
        if (s != last && !has_grad[s][i]) break;
        const double ready = s == last ? clock[s] : grad_ready[s][i];
        start = std::max(clock[s], ready);
        end = start + bwd[s][i] - (kind == 'I' ? weight[s][i] : 0.0);  // (start + B) - W, as the Python
      }
      out.busy[s] += end - start;
      clock[s] = end;
      pos[s] += 1;
      if (record) out.events.push_back({static_cast<int64_t>(s), 0, kind, static_cast<int64_t>(i), start, end});
      if (kind == 'F' && s < last) {
        const double begin = std::max(end, fwd_link_free[s]);
        fwd_link_free[s] = act_ready[s + 1][i] = begin + transfer[s][i];
        has_act[s + 1][i] = 1;
        sent_fwd = true;
        if (record) out.events.push_back({static_cast<int64_t>(s), 1, kind, static_cast<int64_t>(i), begin, fwd_link_free[s]});
      } else if ((kind == 'B' || kind == 'I') && s > 0) {
        const double begin = std::max(end, bwd_link_free[s]);
        bwd_link_free[s] = grad_ready[s - 1][i] = begin + transfer[s - 1][i];
        has_grad[s - 1][i] = 1;
        sent_bwd = true;
        if (record) out.events.push_back({static_cast<int64_t>(s), 2, kind, static_cast<int64_t>(i), begin, bwd_link_free[s]});
      }
    }
    // wake a neighbour only when this stage handed it something it may be waiting for
    const size_t peers[2] = {s + 1, s - 1};
    const bool sent[2] = {sent_fwd, s > 0 && sent_bwd};
    for (int p = 0; p < 2; ++p) {
      const size_t peer = peers[p];
      if (sent[p] && !queued[peer] && pos[peer] < stages[peer].kinds.size()) {
        queued[peer] = 1;
        pending.push_back(peer);
      }
    }
  }

  std::string blocked;
  for (size_t s = 0; s < n; ++s)
    if (pos[s] < stages[s].kinds.size())
      blocked += (blocked.empty() ? "" : ", ") + std::string("stage ") + std::to_string(s) + " at " +
                 detail::op_name(stages[s].kinds[pos[s]], stages[s].mbs[pos[s]]);
  if (!blocked.empty())
    throw std::invalid_argument("schedule deadlocks: stages wait on each other in a cycle (" + blocked + ")");

  out.makespan = *std::max_element(clock.begin(), clock.end());
  for (size_t s = 0; s < n; ++s) out.peak.push_back(detail::stage_peak(stages[s], micro_batches, s));
  return out;
}

}  // namespace dyn
